"""ops/: operations: Prometheus metrics, the read-only HTTP server, the job page, JSON logs."""
