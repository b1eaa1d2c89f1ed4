"""The pure core: no network, no process state; imports nothing else of ours.

pb/ (generated wire modules) - identity.py and signing.py (Ed25519 peers, domain-tagged
signatures) - jobspec.py - admission.py (per-group checks) - grpo/ (advantages, losses,
metrics) - adapter.py (canonical hashing, snapshots, exact deltas) - updates.py (signed-update
chunks, reassembly, replicas) - envs/ (environments and reward functions) - verdicts.py
(verdict semantics shared by validators and trainers).
"""
