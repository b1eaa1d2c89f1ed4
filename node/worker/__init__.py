"""The worker process: finds jobs, keeps the base model loaded once with one adapter slot per
job, and runs lease -> catch up -> generate -> grade -> sign -> submit.

session.py (`JobSession`, one job's round, against the trainer client it is handed) - receipts.py (the
trainers' signed receipts it kept: its credit) - red_team.py (adversarial modes for the drill) -
main.py (`run(cfg)`, the process entrypoint).
"""
