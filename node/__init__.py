"""The processes: trainer/, worker/, swarm/ (DHT records, delta gossip, gradient averaging),
inference/ (backends behind one interface) and their shared plumbing (config, runtime, models,
grading pool, gRPC options, SQLite), cli.py (`swarmrl <role>`) and local.py (`swarmrl up`).
"""
