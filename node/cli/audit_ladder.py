"""`swarmrl audit JOB --recheck`: the validator's ladder on every sampled credited batch that
passes the books' checks (re-grading, recomputed log-probs of the sampled tokens, freshness,
duplicates, episode replay: `ValidatorService.recheck_for`), run by the auditor itself with the
job's base model loaded from `--cache-dir` (docs/CREDIT.md section 3). A credited batch that fails
it is `failed_recheck`; nothing is recorded against any worker (the validator's stores live in a
temporary folder for the one audit).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from swarmrl.node.cli.checks import UsageError

if TYPE_CHECKING:
    from swarmrl.node.audit.books import Recheck
    from swarmrl.node.audit.client import AuditClient
    from swarmrl.node.swarm.dht import VerifiedRecord
    from swarmrl.protocol.identity import Identity


def record_over_grpc(client: AuditClient, job_id: str, endpoint: str, tls_sha256: bytes,
                     trainer_id: str = "") -> VerifiedRecord:
    """The job record the ladder needs, for a trainer audited at `endpoint` (no DHT): its spec
    from the trainer's status, its public key from its first signed statement (whose signer
    must be `trainer_id`, default the status's).

    Raises:
        UsageError: the trainer does not host the job, or has signed no statement yet.
    """
    from swarmrl.node.swarm.dht import VerifiedRecord
    from swarmrl.protocol.jobspec import JobSpec
    from swarmrl.protocol.pb import swarm_pb2 as pb
    from swarmrl.protocol.signing import signer_id

    status = client.status(job_id)
    if status.state == "unknown":
        raise UsageError(f"the trainer does not host job {job_id!r}")
    trainer_id = trainer_id or status.trainer_id
    keys = [bytes(e.public_key) for e in client.page(job_id, 0, 1) if signer_id(e) == trainer_id]
    if not keys:
        raise UsageError(f"--recheck: trainer {trainer_id[:16]} has signed no statement of job {job_id!r} yet")
    spec = JobSpec.from_json(status.spec_json)
    record = pb.JobRecord(job_id=job_id, trainer_id=trainer_id, endpoint=endpoint, base_model=spec.base_model,
                          base_model_sha256=bytes.fromhex(spec.base_model_sha256), spec_json=status.spec_json,
                          trainer_public_key=keys[0], tls_cert_sha256=tls_sha256)
    return VerifiedRecord(record, trainer_id, keys[0])


@contextmanager
def ladder(rec: VerifiedRecord, auditor: Identity, cache_dir: Path | None) -> Iterator[Recheck]:
    """The ladder as an audit's recheck of `rec`'s job, its base model loaded (CPU unless the
    machine has CUDA); unloaded on exit.

    Raises:
        UsageError: this machine can't judge the job (its base model is not in the cache, or its
            environment is not installed).
    """
    from swarmrl.node.runtime.config import ValidatorConfig
    from swarmrl.validator.service import ValidatorService

    with tempfile.TemporaryDirectory(prefix="swarmrl-audit-") as state:
        cfg = ValidatorConfig(key=Path(state) / "unused.key", state_dir=Path(state), cache_dir=cache_dir)
        service = ValidatorService(cfg, auditor)
        try:
            recheck = service.recheck_for(rec)
            if recheck is None:
                r = rec.record
                raise UsageError(f"--recheck: this machine can't judge job {r.job_id!r}: its base model {r.base_model} "
                                 f"({r.base_model_sha256.hex()[:12]}) is not in the cache (--cache-dir), or its "
                                 "environment is not installed (swarmrl env list)")
            yield recheck
        finally:
            service.close()
