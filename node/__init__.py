"""The processes: trainer/, worker/, swarm/ (DHT records, delta gossip, gradient averaging),
inference/ (backends behind one interface) and their shared plumbing (config, runtime, base
models: models / model_recipes / causal_lm, grading pool, gRPC options, SQLite), the command line
(cli.py: parser and commands; cli_checks.py, cli_status.py) and `swarmrl up` (up.py, the driver;
local.py, its processes; up_summary.py, its outputs).
"""
