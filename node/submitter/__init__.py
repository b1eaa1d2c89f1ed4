"""submitter/: the submitter's client: sign a job, submit it, follow its status, fetch its adapter."""
