"""A version replaced by a cotrainer's (a split repaired) stays known by its hash: the trainer's
admission tells a batch sampled with it (`published`) from one naming a hash it never published,
the replaced delta is never served again, and the record survives a restart."""

from __future__ import annotations

from pathlib import Path

import torch

from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

JOB = "ab" * 16
ME, COTRAINER = Identity.from_seed(b"m" * 32), Identity.from_seed(b"c" * 32)


def _states(seed: int, n: int) -> list[ad.State]:
    gen = torch.Generator().manual_seed(seed)
    out = [{"a.lora_A.weight": torch.zeros(4, 16), "a.lora_B.weight": torch.zeros(16, 4)}]
    for _ in range(n):
        out.append({k: t + 0.01 * torch.randn(t.shape, generator=gen) for k, t in out[-1].items()})
    return out


def test_a_replaced_version_is_known_by_both_hashes_and_served_as_the_cotrainers(tmp_path: Path) -> None:
    mine, theirs = AdapterStore(tmp_path / "me", JOB, ME), AdapterStore(tmp_path / "co", JOB, COTRAINER)
    ours_s, theirs_s = _states(0, 2), _states(1, 2)
    for store, states in ((mine, ours_s), (theirs, theirs_s)):
        store.put_snapshot(0, states[0])
    exact1, _ = mine.publish(1, ours_s[0], ours_s[1], carry=False)
    their1, update = theirs.publish(1, theirs_s[0], theirs_s[1], carry=False)
    my_hash, their_hash = ad.adapter_hash(exact1), ad.adapter_hash(their1)
    assert my_hash != their_hash and mine.published(1, my_hash) and not mine.published(1, their_hash)

    mine.adopt(pb.AdapterUpdate.FromString(update.header.body), update.payload, their1)   # the split repaired

    assert mine.published(1, their_hash) and mine.published(1, my_hash)   # admitted before: still ours
    assert not mine.published(1, bytes(32)) and not mine.published(1, b"")
    header = mine.header(1)
    assert header is not None and bytes(header.to_hash) == their_hash   # served: the adopted version only
    assert ad.adapter_hash(mine.state_at(1) or {}) == their_hash
    again = AdapterStore(tmp_path / "me", JOB, ME)   # a restart keeps the record
    assert again.published(1, my_hash) and again.published(1, their_hash) and not again.published(1, bytes(32))
    assert again.published(7, bytes(32))   # a version not kept here: nothing to tell it by


def test_an_unreadable_record_is_logged_and_ignored(tmp_path: Path, caplog) -> None:
    store = AdapterStore(tmp_path / "me", JOB, ME)
    store.put_snapshot(0, _states(0, 0)[0])
    (tmp_path / "me" / "superseded.json").write_text("{not json")
    again = AdapterStore(tmp_path / "me", JOB, ME)
    assert not again.published(0, bytes(32)) and "unreadable" in caplog.text
