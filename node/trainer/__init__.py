"""The trainer process: hosts jobs, leases work, admits rollouts, steps, publishes, checkpoints.

leases.py (`LeaseBook`) - ledger.py (SQLite: jobs, leases, admitted groups, steps) -
bans.py (strikes and bans) - learner.py (the LoRA model and its GRPO step) - adapter_store.py
(published versions and their signed updates) - checkpoint.py - job.py (one job's runtime) -
calls.py (`TrainerCalls`: the answer to each call, whatever carried it) - service.py (the gRPC
servicer over it) - main.py (`run(cfg)`, the process entrypoint).
"""
