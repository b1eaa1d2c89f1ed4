"""The swarm layer: it moves bytes and tensors and knows no role (never imports the worker,
trainer or validator).

dht.py (hivemind DHT nodes, signed job records) - holders.py (who holds which adapter update) -
gossip.py (serving and fetching signed updates over libp2p streams) - catchup.py (a replica
brought up to a version, peers first, the trainer as fallback) - cotrainers.py (a job's other
trainers) - averaging.py (exact, NaN-proof gradient averaging) - trainer_state.py (a trainer's
shareable state) - job_swarm.py (one job's averaging and state sharing) - statement_records.py
and statement_gossip.py (contribution statements: who serves them, served over libp2p) -
figures.py.
"""
