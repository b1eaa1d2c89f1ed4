"""The trainer ledger's tables (SQLite): jobs, leases, batches and their groups, steps, and what the
ledger keeps per peer (rejections, verdicts, bans, strikes), and the signed contribution
statements (`ledger_credit`). `Ledger` creates them if missing."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, envelope BLOB NOT NULL, created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, peer_id TEXT NOT NULL, lease BLOB NOT NULL,
    deadline_ms INTEGER NOT NULL, open INTEGER NOT NULL DEFAULT 1);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, batch_id TEXT UNIQUE NOT NULL, job_id TEXT NOT NULL,
    peer_id TEXT NOT NULL, lease_id TEXT NOT NULL, received_ms INTEGER NOT NULL, envelope BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT, batch_seq INTEGER NOT NULL, job_id TEXT NOT NULL,
    lease_id TEXT NOT NULL, peer_id TEXT NOT NULL, prompt_index INTEGER NOT NULL,
    policy_version INTEGER NOT NULL, grp BLOB NOT NULL, state TEXT NOT NULL DEFAULT 'pending',
    step INTEGER, note TEXT, UNIQUE (job_id, prompt_index));
CREATE INDEX IF NOT EXISTS groups_pending ON groups (job_id, state, id);
CREATE INDEX IF NOT EXISTS groups_batch ON groups (batch_seq);
CREATE INDEX IF NOT EXISTS batches_lease ON batches (lease_id);
CREATE INDEX IF NOT EXISTS batches_whole ON batches (job_id, received_ms) WHERE length(envelope) > 0;
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, peer_id TEXT NOT NULL,
    reason TEXT NOT NULL, at_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, metrics TEXT NOT NULL, PRIMARY KEY (job_id, step));
CREATE TABLE IF NOT EXISTS verdicts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, validator_id TEXT NOT NULL,
    peer_id TEXT NOT NULL, batch_id TEXT NOT NULL, prompt_index INTEGER NOT NULL,
    passed INTEGER NOT NULL, checkname TEXT NOT NULL, detail TEXT NOT NULL, at_ms INTEGER NOT NULL,
    UNIQUE (validator_id, batch_id, prompt_index));
CREATE TABLE IF NOT EXISTS bans (
    job_id TEXT NOT NULL, peer_id TEXT NOT NULL, reason TEXT NOT NULL, at_ms INTEGER NOT NULL,
    until_ms INTEGER NOT NULL, PRIMARY KEY (job_id, peer_id));
CREATE INDEX IF NOT EXISTS verdicts_peer ON verdicts (job_id, peer_id, passed);
CREATE TABLE IF NOT EXISTS statements (
    job_id TEXT NOT NULL, version INTEGER NOT NULL, sha256 BLOB NOT NULL, envelope BLOB NOT NULL,
    PRIMARY KEY (job_id, version));
CREATE TABLE IF NOT EXISTS stated_groups (group_id INTEGER PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS strikes (
    job_id TEXT NOT NULL, peer_id TEXT NOT NULL, count INTEGER NOT NULL, PRIMARY KEY (job_id, peer_id));
"""
