"""A job's contribution statements at its trainer (`protocol.credit`, docs/CREDIT.md): one per
published version, made by the step that published it and stored in the ledger in the
transaction that marks its groups trained (`ledger_credit.CreditTables.record_statement`).

A version this trainer did not train itself (adopted from a cotrainer), or whose step crashed
between publishing and recording, gets an empty statement when the next one is made or the job
resumes (`fill`): a chain has no gaps, and the crashed step's groups, still pending, are credited
to the version that trains them. The job record names the head statement (`head`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.red_team import StatementDrill
from swarmrl.protocol.credit import ConsumedGroup, build_statement, sign_statement, statement_sha256
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
DEFAULT_STATEMENTS = 16   # statements a FetchStatements call gets when it asks for none
MAX_STATEMENTS = 64       # the most one call returns


class StatementBook:
    """The signed statements of one job at this trainer. Thread-safe (one statement at a time).

    now_ms: the job's clock (unix ms), for `created_ms`; drill: a cheating trainer's lies
    (`red_team.StatementDrill`, local drills only; None: the truth)."""

    def __init__(self, job_id: str, identity: Identity, ledger: Ledger, store: AdapterStore,
                 now_ms: Callable[[], int], drill: StatementDrill | None = None) -> None:
        self.job_id, self.identity, self.ledger, self.store, self.now_ms = job_id, identity, ledger, store, now_ms
        self.drill = drill
        self._lock = threading.Lock()
        self._head = ledger.last_statement(job_id)

    def head(self) -> tuple[int, bytes]:
        """(version, sha256) of the newest statement; (0, b"") before the first."""
        head = self._head
        if head is None:
            return 0, b""
        return pb.ContributionStatement.FromString(head.body).version, statement_sha256(head)

    def state(self, version: int, trained: Iterable[int]) -> pb.Signed:
        """Sign and store the statement of `version`, crediting the groups with ledger ids
        `trained` (still pending: marked trained in the same transaction) and listing the groups
        consumed without credit since the previous statement. Versions before it without a
        statement get empty ones first (`fill`). Returns the stored statement (an earlier one of
        the same version, if a statement of it was stored before)."""
        ids = list(trained)
        with self._lock:
            self._fill(version - 1)
            return self._state(version, self.ledger.consumed_groups(ids), ids)

    def fill(self, version: int) -> None:
        """Give every version up to `version` without a statement an empty one (its groups, if
        any, are credited by the statement of the version that trains them)."""
        with self._lock:
            self._fill(version)

    def _fill(self, version: int) -> None:
        start = self.head()[0] + 1 if self._head is not None else self._first_version(version)
        for v in range(start, version + 1):
            self._state(v, [], [])

    def _first_version(self, version: int) -> int:
        """Where a chain starts: version 1, or (a cotrainer that joined late, a ledger older than
        statements) the oldest version whose signed update is still kept, at most `version`+1."""
        v = 1
        while v <= version and self.store.header(v) is None:
            v += 1
        return v

    def _state(self, version: int, trained: list[ConsumedGroup], trained_ids: list[int]) -> pb.Signed:
        update = self.store.header(version) or pb.AdapterUpdate(job_id=self.job_id, to_version=version)
        listed, dropped = self.ledger.unstated_drops(self.job_id)
        credited: list[ConsumedGroup] = trained
        if self.drill is not None:   # the ledger records the truth (trained_ids); the statement lies
            credited, update = self.drill.trained(version, trained), self.drill.update(update)
        statement = build_statement(self.job_id, version, update, self._head, credited, dropped, self.now_ms())
        envelope = sign_statement(self.identity, statement)
        stored = self.ledger.record_statement(self.job_id, version, envelope, trained=trained_ids, listed=listed)
        if stored is not envelope:
            log.warning("job %s: version %d already has a statement; kept it", self.job_id[:12], version)
        self._head = stored
        return stored

    def count(self) -> int:
        """How many statements of the job this trainer has signed (its chain's length: a chain has
        no gaps, so head version - first version + 1; 0 before the first)."""
        head = self._head
        if head is None:
            return 0
        st = pb.ContributionStatement.FromString(head.body)
        return int(st.version - st.first_version + 1)

    def fetch(self, after_version: int, max_statements: int) -> list[pb.Signed]:
        """Statements above `after_version`, ascending: at most `max_statements` (0: the default
        DEFAULT_STATEMENTS; capped at MAX_STATEMENTS)."""
        limit = max(1, min(max_statements or DEFAULT_STATEMENTS, MAX_STATEMENTS))
        return self.ledger.statements(self.job_id, after_version, limit)
