"""Bounds a node puts on its callers, as plain data (loaded with the role's config):

- `GrpcLimits`: how much a gRPC server lets its callers hold, built into a server by
  `node.net.grpc_server.build_server` and enforced per call by `node.net.grpc_guard.StreamGuard`.
  Why these bounds: grpcio's synchronous server runs every call on a thread of one pool, and a
  streaming call holds its thread while the peer reads (or sends) slowly. Without bounds, a
  handful of slow downloaders take every thread and lease requests queue silently until their
  callers time out. With them, streams can never hold more than `max_streams` threads, the pool
  keeps `unary_threads` more for short calls, and a call over a bound is refused at once
  (RESOURCE_EXHAUSTED with a retry hint) instead of waiting.
- `RateLimits`: a trainer's token buckets on lease requests and rollout submissions, enforced by
  `node.net.rate_limits.RateLimiter`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GrpcLimits(BaseModel):
    """Concurrency, deadline and idle bounds of one gRPC server (times in seconds).

    A "stream" is any call with a streaming request or response (adapter and data-set downloads,
    `SampleAdmitted`, `SubmitRollouts`, health `Watch`). A "peer" is the peer id the caller names
    in its `swarmrl-peer` metadata (workers do); a caller naming none is bounded per address
    only, and the per-address bound holds however many peer ids one address claims.
    """

    model_config = ConfigDict(extra="forbid")

    max_streams: int = Field(32, ge=1)              # concurrent streams, all callers together
    max_streams_per_peer: int = Field(4, ge=1)      # ... per claimed peer id
    max_streams_per_address: int = Field(32, ge=1)  # ... per source IP (IPv6: per /64)
    unary_threads: int = Field(8, ge=1)             # threads beyond max_streams, for short calls
    # calls queued beyond the pool before grpcio itself refuses them (RESOURCE_EXHAUSTED, no hint)
    max_queued_calls: int = Field(64, ge=0)
    stream_deadline_s: float = Field(600.0, gt=0)   # a stream is ended after this long
    stream_idle_s: float = Field(60.0, gt=0)        # ... or after this long without a message either way
    retry_after_s: float = Field(1.0, gt=0)         # the retry hint a refusal carries
    reap_every_s: float = Field(1.0, gt=0)          # how often overdue streams are looked for
    # methods whose streams may idle for as long as the deadline allows (a health Watch is idle
    # by nature: it speaks only when the status changes)
    idle_exempt: list[str] = ["/grpc.health.v1.Health/Watch"]

    @property
    def threads(self) -> int:
        """The server's thread pool: every stream we admit, plus the threads for short calls."""
        return self.max_streams + self.unary_threads

    @property
    def max_concurrent_rpcs(self) -> int:
        """grpcio's own bound on calls in the server (running + queued)."""
        return self.threads + self.max_queued_calls


class Rate(BaseModel):
    """One token bucket's shape: `burst` calls at once, `per_s` a second sustained."""

    model_config = ConfigDict(extra="forbid")

    per_s: float = Field(gt=0)
    burst: int = Field(ge=1)


class RateLimits(BaseModel):
    """A trainer's rate limits (plain data). Defaults leave a well-behaved worker (one lease and
    one submission per generation round, rounds of a second or more) far below them, and a
    local swarm of tens of workers on one address too."""

    model_config = ConfigDict(extra="forbid")

    lease_per_peer: Rate = Rate(per_s=5, burst=20)
    submit_per_peer: Rate = Rate(per_s=5, burst=20)
    lease_per_address: Rate = Rate(per_s=100, burst=400)
    submit_per_address: Rate = Rate(per_s=100, burst=400)
    max_keys: int = Field(100_000, ge=1)   # buckets kept per table
