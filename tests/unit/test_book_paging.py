"""protocol/book_paging.py: a trainer's books read whole, a page at a time."""

from __future__ import annotations

from swarmrl.protocol import credit
from swarmrl.protocol.audit import statement_version
from swarmrl.protocol.book_paging import all_statements, batches_by_id
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.signing import envelope_id

TRAINER = Identity.from_seed(b"t" * 32)


def _statement(version: int) -> pb.Signed:
    return credit.sign_statement(TRAINER, pb.ContributionStatement(job_id="j", version=version))


CHAIN = [_statement(v) for v in range(1, 8)]


def test_pages_are_read_until_an_empty_one():
    asked = []

    def fetch(after: int) -> list[pb.Signed]:
        asked.append(after)
        return [e for e in CHAIN if statement_version(e) > after][:3]

    assert all_statements(fetch) == CHAIN and asked == [0, 3, 6, 7]


def test_a_trainer_serving_the_same_page_again_cannot_keep_the_reader_paging():
    assert len(all_statements(lambda after: CHAIN[:2], limit=10)) == 10
    assert all_statements(lambda after: [], limit=10) == []


def test_batches_are_asked_in_pages_and_keyed_by_their_envelopes_id():
    batches = [pb.AdmittedBatch(batch=pb.Signed(body=bytes([i]))) for i in range(5)]
    ids = [envelope_id(b.batch) for b in batches]
    pages = []

    def sample(page: list[str]) -> list[pb.AdmittedBatch]:
        pages.append(page)
        return [b for b in batches if envelope_id(b.batch) in page]

    got = batches_by_id(sample, ids, page=2)
    assert pages == [ids[0:2], ids[2:4], ids[4:5]] and got == dict(zip(ids, batches, strict=True))
