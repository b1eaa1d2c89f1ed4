"""bootstrap/: the bootstrap peer: a DHT node with a stable address that others join through."""
