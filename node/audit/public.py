"""A trainer's books read from the public record (issue 27 items 2-3, docs/CREDIT.md section 2):
what `swarmrl audit JOB --initial-peers MADDR` audits when no `--trainer` is named.

The trainer is found by its signed job record in the DHT (or, once the record has expired, by
the signed `StatementHolder` records that still name its chain). Its statements come peer to peer
from whichever holder answers, newest head first (the trainer, or a mirror that checked the
chain: `swarm.statement_gossip`), each holder's answer checked against the head's content
address its record named; a holder that fails or lies is skipped and named. Credited batches
and signed update headers come from the trainer's gRPC endpoint in its record (TLS pinned to the
record's certificate); once the trainer is gone they are unavailable, and the audit checks the
chain and the receipts only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import hivemind

from swarmrl.node.audit.books import AuditUnreachable
from swarmrl.node.audit.client import AuditClient
from swarmrl.node.swarm.dht import VerifiedRecord, find_jobs
from swarmrl.node.swarm.statement_gossip import StatementGossip
from swarmrl.node.swarm.statement_records import StatementSource, find_statement_sources
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
PUBLIC_STATE = "public-record"   # the state `PublicBooks.status` reports (the audit reads no trainer's status)


class PublicBooks:
    """`books.AuditBooks` from the public record of `job_id` in the swarm `dht` joins (one trainer's
    chain: `trainer_id`, needed when the job has several trainers). `holders_tried` names each
    holder that failed and why; `holder` is the one whose statements were read; `verified` the
    trainer's signed job record (None once it has expired), `record` its body.

    Raises (on construction):
        AuditUnreachable: the swarm names no trainer of the job, or several and none was chosen.
    """

    def __init__(self, dht: hivemind.DHT, job_id: str, trainer_id: str = "", timeout_s: float = 30) -> None:
        records = [r for r in find_jobs(dht)
                   if r.record.job_id == job_id and (not trainer_id or r.trainer_id == trainer_id)]
        sources = find_statement_sources(dht, job_id, trainer_id)
        trainers = sorted({r.trainer_id for r in records} | {s.trainer_id for s in sources})
        if not trainers:
            raise AuditUnreachable(f"the swarm has no job record and no statement holder of job {job_id!r}")
        if len(trainers) > 1:
            raise AuditUnreachable(f"job {job_id!r} has {len(trainers)} trainers ({', '.join(t[:16] for t in trainers)}): "
                                   "name one with --trainer-id")
        self.trainer_id = trainers[0]
        self.verified: VerifiedRecord | None = records[0] if records else None
        self.record: pb.JobRecord | None = records[0].record if records else None
        self.sources = [s for s in sources if s.trainer_id == self.trainer_id]
        self.holder: StatementSource | None = None
        self.holders_tried: list[str] = []
        self.timeout_s = timeout_s
        self._gossip = StatementGossip(dht, Identity.generate(), dialable=False)
        self._client = AuditClient(self.record.endpoint, bytes(self.record.tls_cert_sha256), timeout_s) \
            if self.record is not None and self.record.endpoint else None

    def close(self) -> None:
        """Close the libp2p client and the trainer's channel."""
        self._gossip.shutdown()
        if self._client is not None:
            self._client.close()

    def status(self, job_id: str) -> pb.JobStatus:
        """What the audit needs of a status: the trainer's id and, from its record, the job spec."""
        return pb.JobStatus(job_id=job_id, state=PUBLIC_STATE, trainer_id=self.trainer_id,
                            spec_json=self.record.spec_json if self.record is not None else "")

    def statements(self, job_id: str) -> list[pb.Signed]:
        """The chain of the first holder (newest head first) that serves it whole to its head.

        Raises:
            AuditUnreachable: no holder is announced, or none served its chain.
        """
        if not self.sources:
            raise AuditUnreachable(f"nobody announces the statements of job {job_id!r} by trainer "
                                   f"{self.trainer_id[:16]}")
        for source in self.sources:
            try:
                chain = self._gossip.chain_from(source, job_id)
            except Exception as exc:  # noqa: BLE001 - a holder can fail or lie in any way: try the next
                self.holders_tried.append(f"{source.holder_id[:16]}: {exc!r}"[:300])
                log.info("statement holder %s failed: %r", source.holder_id[:16], exc)
                continue
            self.holder = source
            return chain
        raise AuditUnreachable(f"no holder served the statements of job {job_id!r} ({len(self.sources)} tried: "
                               f"{'; '.join(self.holders_tried)})")

    def batches(self, job_id: str, batch_ids: Iterable[str]) -> dict[str, pb.AdmittedBatch] | None:
        """The credited batches the trainer still serves; None when it can't be reached."""
        if self._client is None:
            return None
        try:
            return self._client.batches(job_id, batch_ids)
        except Exception as exc:  # noqa: BLE001 - the trainer gone: the batches are unavailable, not findings
            log.info("the trainer's batches are unavailable: %r", exc)
            return None

    def update_header(self, job_id: str, version: int, trainer_id: str) -> pb.AdapterUpdate | None:
        """The trainer's signed update header of `version`; None when it can't be reached."""
        return self._client.update_header(job_id, version, trainer_id) if self._client is not None else None
