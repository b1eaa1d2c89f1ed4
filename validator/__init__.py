"""The validator: spot-checks admitted rollouts, keeps peer reputation, reports verdicts.

checks.py (the ladder, cheapest first) - plausibility.py (e-value tests on sampled tokens) -
rescoring.py (one prefill: log-probs + plausibility statistics) - adapters.py (signed snapshots
per (job, version), LRU) - sampling.py (keyed group draws) - seen.py (first sightings, cursors) -
reputation.py (per-peer scores and bans) - validator.py (`Validator.validate_batch`, no network)
- service.py (rounds against trainers) - main.py (`run(cfg)`, the process entrypoint).
"""
