"""net/: the gRPC plumbing every server and client shares: message limits, channel options, stream
guards, rate limits, retries with back-off, TLS, the standard health and reflection services."""
