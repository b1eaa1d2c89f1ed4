"""Reading a trainer's credit books whole, a page at a time: its signed statements by version,
its admitted batches by id. One rule for every reader of the books (`Books` in
`protocol/leaderboard.py`): the gRPC `AuditClient` and the trainer's own `LocalBooks` pass the
call that fetches one page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from swarmrl.protocol.audit import statement_version
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.signing import envelope_id

CHAIN_LIMIT = 1_000_000   # a reader stops paging there (a chain longer than any job)
BATCH_PAGE = 256          # batch ids asked per call (the trainer's cap on SampleAdmitted)


def all_statements(fetch: Callable[[int], Sequence[pb.Signed]], limit: int = CHAIN_LIMIT) -> list[pb.Signed]:
    """Every statement, ascending: `fetch(after_version)` returns the next page (statements
    above that version, ascending; empty at the end). Stops after `limit` statements; a page
    that does not advance past `after_version` still moves on by one version, so a trainer that
    serves the same page again can't keep the reader paging forever."""
    out: list[pb.Signed] = []
    after = 0
    while len(out) < limit:
        page = fetch(after)
        if not page:
            break
        out += page
        after = max(after + 1, *(statement_version(e) for e in page))
    return out


def batches_by_id(sample: Callable[[list[str]], Iterable[pb.AdmittedBatch]], batch_ids: Iterable[str],
                  page: int = BATCH_PAGE) -> dict[str, pb.AdmittedBatch]:
    """The batches a trainer serves for `batch_ids` (hex), keyed by the id of the envelope each
    carries (the caller checks it against what it asked): `sample(ids)` serves one page."""
    ids, out = list(batch_ids), {}
    for lo in range(0, len(ids), page):
        for ab in sample(ids[lo:lo + page]):
            out[envelope_id(ab.batch)] = ab
    return out
