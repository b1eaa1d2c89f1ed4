"""Contribution statements peer to peer: a trainer, or a mirror that checked its chain, serves a
job's signed statements over hivemind's libp2p streams and announces the head it serves in the
DHT (`statement_records`); anyone reads them from whichever holder answers (issue 27 item 2,
docs/CREDIT.md section 2).

Protocol `swarmrl.v1.FetchStatements`: a `StatementRequest` (job, trainer, statements above
`after_version`, at most `max_statements`) answers a stream of signed statements, ascending,
capped at `PAGE` statements and `PAGE_BYTES` bytes (at least one statement; a reader refuses a
longer answer). The statements are the
trainer's signed bodies, so a holder can withhold or reorder them but not forge one; a reader
checks what it got as a chain (`protocol.audit.check_chain`) ending at the head's content
address the holder's signed record named (`chain_from`).

A `StatementMirror` keeps verified chains (in memory, the newest `keep` per node) so that a
validator in audit mode can serve the record of a trainer that has gone away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence

import hivemind
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmrl.node.swarm.dht import REFRESH_S
from swarmrl.node.swarm.gossip import LoopThread
from swarmrl.node.swarm.statement_records import StatementSource, announce_statements
from swarmrl.protocol.audit import statement_version
from swarmrl.protocol.book_paging import all_statements
from swarmrl.protocol.credit import statement_sha256
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
PROTOCOL = "swarmrl.v1.FetchStatements"
PAGE = 64                  # statements per answer at most
PAGE_BYTES = 1 << 20       # bytes per answer at most (hivemind's unary messages stop at 4 MiB)
CALL_TIMEOUT_S = 20.0
NEW_HEAD_S = 2.0           # a holder's record follows a moving head at most this often (one DHT store each)

Source = Callable[[str, str, int, int], list[pb.Signed]]
"""(job_id, trainer_id, after_version, max_statements) -> that trainer's signed statements of the
job above `after_version`, ascending, at most `max_statements` (empty: none held)."""


class ChainError(ValueError):
    """What a holder served does not end at the head its signed record named."""


class StatementMirror:
    """Verified statement chains kept to serve, per (job, trainer): the newest `keep` chains.
    Thread-safe. The caller verifies a chain before `keep` (a mirror vouches for where, not what).

    Raises:
        ValueError: keep < 1.
    """

    def __init__(self, keep: int = 64) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep_chains = keep
        self._chains: OrderedDict[tuple[str, str], list[pb.Signed]] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, job_id: str, trainer_id: str, envelopes: Sequence[pb.Signed]) -> None:
        """Hold `envelopes` (ascending versions) as `trainer_id`'s chain of `job_id`; a chain
        shorter than the one held is ignored (a mirror never goes back)."""
        if not envelopes:
            return
        key = (job_id, trainer_id)
        with self._lock:
            if len(self._chains.get(key, ())) > len(envelopes):
                return
            self._chains[key] = list(envelopes)
            self._chains.move_to_end(key)
            while len(self._chains) > self.keep_chains:
                self._chains.popitem(last=False)

    def page(self, job_id: str, trainer_id: str, after_version: int, max_statements: int) -> list[pb.Signed]:
        """A `Source`: the held statements above `after_version`, at most `max_statements`."""
        with self._lock:
            chain = self._chains.get((job_id, trainer_id), [])
            return [e for e in chain if statement_version(e) > after_version][:max_statements]

    def head(self, job_id: str, trainer_id: str) -> tuple[int, bytes, int]:
        """(head version, its content address, statements held); (0, b"", 0) when none."""
        with self._lock:
            chain = self._chains.get((job_id, trainer_id), [])
            return (statement_version(chain[-1]), statement_sha256(chain[-1]), len(chain)) if chain else (0, b"", 0)

    def chains(self) -> list[tuple[str, str]]:
        """The (job id, trainer id) pairs held."""
        with self._lock:
            return list(self._chains)


class StatementGossip:
    """Serves statements from `source` over libp2p (none when `source` is None: a reader only),
    announces heads in the DHT, and reads other holders' statements. `served[job]` counts
    statements sent to other peers. dialable: False for a peer nobody can dial (client mode): it
    reads but never announces."""

    def __init__(self, dht: hivemind.DHT, identity: Identity, source: Source | None = None, *,
                 dialable: bool = True) -> None:
        self.dht, self.identity, self.source, self.dialable = dht, identity, source, dialable
        self.served: Counter[str] = Counter()
        self._loop = LoopThread("swarmrl-statements")
        self.p2p: hivemind.P2P = self._loop.run(self._start(), timeout=60)
        self.libp2p_peer_id: bytes = self.p2p.peer_id.to_bytes()
        self.maddrs: list[str] = [str(m) for m in dht.get_visible_maddrs()] if dialable else []
        self._announced: dict[tuple[str, str], tuple[float, int]] = {}   # -> (monotonic s, head version)
        self._lock = threading.Lock()
        self._closed = False

    async def _start(self) -> hivemind.P2P:
        p2p = await self.dht.replicate_p2p()
        if self.source is not None:
            await p2p.add_protobuf_handler(PROTOCOL, self._serve, pb.StatementRequest, stream_output=True)
        return p2p

    async def _serve(self, req: pb.StatementRequest, context: P2PContext) -> AsyncIterator[pb.Signed]:
        assert self.source is not None
        want = max(1, min(int(req.max_statements) or PAGE, PAGE))
        trainer = req.trainer_id or self.identity.peer_id
        got = await asyncio.to_thread(self.source, req.job_id, trainer, int(req.after_version), want)
        size = 0
        for i, env in enumerate(got[:want]):
            size += env.ByteSize()
            if i and size > PAGE_BYTES:
                break
            with self._lock:
                self.served[req.job_id] += 1
            yield env

    def announce(self, job_id: str, trainer_id: str, head_version: int, head_sha256: bytes, statements: int, *,
                 force: bool = False) -> None:
        """Announce that this peer serves `trainer_id`'s statements of `job_id` up to `head_version`:
        a new head at most every `NEW_HEAD_S` (a trainer steps faster than that: its record may
        lag a few versions; readers audit up to the head a record names), an unchanged one when
        its record is due for refresh, anything with `force`. Nothing when this peer serves
        nothing, can't be dialled, or has no head yet; a DHT failure is logged (the next call
        retries)."""
        if self.source is None or not self.dialable or head_version < 1:
            return
        key = (job_id, trainer_id)
        at, version = self._announced.get(key, (0.0, 0))
        since = time.monotonic() - at
        if not force and since < (REFRESH_S if version == head_version else NEW_HEAD_S):
            return
        try:
            announce_statements(self.dht, self.identity, job_id=job_id, trainer_id=trainer_id,
                                head_version=head_version, head_sha256=head_sha256, statements=statements,
                                libp2p_peer_id=self.libp2p_peer_id, maddrs=self.maddrs,
                                now_ms=int(time.time() * 1000))
            self._announced[key] = (time.monotonic(), head_version)
        except Exception as exc:  # noqa: BLE001 - the DHT can fail; the next call retries
            log.warning("announcing statements of job %s failed: %r", job_id[:12], exc)

    def page(self, source: StatementSource, job_id: str, after_version: int, max_statements: int = PAGE,
             timeout_s: float = CALL_TIMEOUT_S) -> list[pb.Signed]:
        """One page of `source`'s statements of `job_id` above `after_version`.

        Raises:
            TimeoutError, hivemind P2P errors (the holder can't be reached or failed).
        """
        req = pb.StatementRequest(job_id=job_id, trainer_id=source.trainer_id, after_version=after_version,
                                  max_statements=max_statements)
        return self._loop.run(asyncio.wait_for(self._call(source, req), timeout_s), timeout=timeout_s + 5)

    async def _call(self, source: StatementSource, req: pb.StatementRequest) -> list[pb.Signed]:
        peer = PeerID(source.libp2p_peer_id)
        with contextlib.suppress(Exception):   # dial the record's addresses; the call's own error says more
            await asyncio.wait_for(self.p2p._client.connect(peer, [Multiaddr(m) for m in source.maddrs]), 10)
        out: list[pb.Signed] = []
        size = 0
        async for env in await self.p2p.iterate_protobuf_handler(peer, PROTOCOL, req, pb.Signed):
            size += env.ByteSize()
            if len(out) >= PAGE or size > 2 * PAGE_BYTES:
                raise ValueError(f"holder {source.holder_id[:16]} streamed more than a page")
            out.append(env)
        return out

    def chain_from(self, source: StatementSource, job_id: str) -> list[pb.Signed]:
        """Every statement `source` serves of its trainer's chain of `job_id`, ascending, cut at
        the head its record names; the cut chain's last statement must have that content address.

        Raises:
            ChainError: the holder served no statement of the head's version, or one with another
                content address (a holder that lies about its head, or serves a forked chain).
            TimeoutError, hivemind P2P errors (as `page`).
        """
        chain = [e for e in all_statements(lambda after: self.page(source, job_id, after))
                 if statement_version(e) <= source.head_version]
        if not chain or statement_version(chain[-1]) != source.head_version:
            raise ChainError(f"holder {source.holder_id[:16]} announced head version {source.head_version} and "
                             f"served up to {statement_version(chain[-1]) if chain else 'none'}")
        if statement_sha256(chain[-1]) != source.head_sha256:
            raise ChainError(f"holder {source.holder_id[:16]} served a head of version {source.head_version} whose "
                             f"content address is not the one it announced")
        return chain

    def shutdown(self) -> None:
        """Drop the handler, stop the libp2p client and the loop (best effort, once; never raises)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._loop.run(self._stop(), timeout=10)
        self._loop.stop()

    async def _stop(self) -> None:
        if self.source is not None:
            with contextlib.suppress(Exception):
                await self.p2p.remove_protobuf_handler(PROTOCOL, stream_output=True)
        await self.p2p.shutdown()
