"""net/: the gRPC plumbing every server and client shares: message limits, channel options, stream
guards, rate limits, retries with back-off, TLS, the standard health and reflection services; and
what a worker and a validator ask of a trainer (`trainer_client.py`), over gRPC (`grpc_wire.py`)."""
