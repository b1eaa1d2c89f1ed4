"""tasks/: jobs and their tasks: built-in jobs, job files, grading completions in sandboxed processes,
playing multi-turn episodes."""
