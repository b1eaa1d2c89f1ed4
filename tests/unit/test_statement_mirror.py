"""swarm.statement_gossip.StatementMirror: what a validator keeps of the chains it verified, and
serves: pages above a version, the head's content address, never a shorter chain over a longer
one, the newest `keep` chains."""

from __future__ import annotations

import pytest

from swarmrl.node.swarm.statement_gossip import StatementMirror
from swarmrl.protocol import signing
from swarmrl.protocol.credit import statement_sha256
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

T = Identity.from_seed(b"m" * 32)


def _chain(n: int, job: str = "j") -> list[pb.Signed]:
    return [signing.sign(T, signing.CONTRIBUTION, pb.ContributionStatement(job_id=job, version=v)) for v in range(1, n + 1)]


def test_pages_head_and_no_going_back() -> None:
    m = StatementMirror()
    assert m.head("j", T.peer_id) == (0, b"", 0) and m.page("j", T.peer_id, 0, 10) == []
    chain = _chain(5)
    m.keep("j", T.peer_id, chain)
    assert m.page("j", T.peer_id, 2, 2) == chain[2:4] and m.page("j", "other", 0, 9) == []
    assert m.head("j", T.peer_id) == (5, statement_sha256(chain[-1]), 5)
    m.keep("j", T.peer_id, chain[:3])   # an older, shorter read: ignored
    assert m.head("j", T.peer_id)[0] == 5
    m.keep("j", T.peer_id, _chain(6))
    assert m.head("j", T.peer_id)[0] == 6


def test_keeps_the_newest_chains() -> None:
    m = StatementMirror(keep=2)
    for job in ("a", "b", "c"):
        m.keep(job, T.peer_id, _chain(1, job))
    assert m.chains() == [("b", T.peer_id), ("c", T.peer_id)]
    with pytest.raises(ValueError):
        StatementMirror(keep=0)
