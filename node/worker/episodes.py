"""The worker's multi-turn round: play each leased prompt's G episodes and wrap them as groups.

Replaces single-turn generation (`JobSession.generate`) for environments that play episodes
(`protocol.envs.episode.EpisodeEnv`); the rest of the round (grade -> sign -> submit) is the
same. Every completion is a token-exact trace (`protocol.envs.trace`) with its model mask.
"""

from __future__ import annotations

import os
from typing import Any

from swarmrl.node.inference.base import InferenceBackend, Sampling
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.tasks.episode_play import play_episodes, trace_completion
from swarmrl.protocol.envs.base import PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv
from swarmrl.protocol.episode_limits import episode_limits
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb


def episode_groups(backend: InferenceBackend, spec: JobSpec, env: EpisodeEnv, prompts: list[PromptSpec],
                   lease: pb.Lease, *, adapter: str | None, policy_version: int,
                   adapter_hash: bytes = b"") -> list[pb.Group]:
    """The lease's groups of G episodes each (ungraded), sampled with slot `adapter` (version
    `policy_version`, whose hash is `adapter_hash`) under the lease's sampling parameters (per
    model turn) and the job's episode limits."""
    limits = episode_limits(spec, env)
    assert limits is not None
    s = lease.sampling
    sampling = Sampling(n=1, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                        stop=tuple(s.stop), seed=int.from_bytes(os.urandom(4), "little") >> 1)
    tok: Any = backend.tokenizer
    prompt_ids = [render_prompt(tok, p, spec.chat_template) for p in prompts]
    traces = play_episodes(lambda ids, smp: backend.generate(ids, smp, adapter=adapter), tok, env, prompts,
                           prompt_ids, n=s.n, sampling=sampling, limits=limits)
    return [pb.Group(prompt_index=p.index, prompt_token_ids=ids,
                     completions=[trace_completion(t, policy_version, adapter_hash) for t in episodes])
            for p, ids, episodes in zip(prompts, prompt_ids, traces, strict=True)]
