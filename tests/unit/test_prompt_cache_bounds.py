"""The trainer's prompt-id cache stays bounded over a long job and still gives every prompt's
exact token ids, cached or rendered again (JobRuntime.prompt_ids_of)."""

from __future__ import annotations

import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import PROMPT_CACHE, JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol.identity import Identity
from tests.unit.test_trainer_job import FakeClock, _honest_batch, _lease, _submit


def test_many_prompts_keep_the_cache_bounded_and_the_ids_exact(tmp_path, model_cache) -> None:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=4, batch_groups=4, prompts_per_lease=8)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-prompts", spec, identity=Identity.from_seed(b"t" * 32), ledger=ledger,
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, clock=FakeClock())
    worker = Identity.from_seed(b"w" * 32)
    early = _lease(job, worker)          # answered only after 3 * PROMPT_CACHE other prompts
    early_batch = _honest_batch(job, worker, early)
    for start in range(100, 100 + 3 * PROMPT_CACHE, 64):   # admission asks 64 prompts at a time
        got = job.prompt_ids_of(range(start, start + 64))
        assert list(got) == list(range(start, start + 64))
        assert job.cached_prompts() <= PROMPT_CACHE
    assert job.cached_prompts() == PROMPT_CACHE
    # the newest are served from the cache, an evicted one is rendered again: both exact
    for index in (100, 100 + 3 * PROMPT_CACHE - 1, early.prompt_indices[0]):
        want = render_prompt(job.learner.tokenizer, job.env.prompt(spec.seed, index), spec.chat_template)
        assert job.prompt_ids(index) == want
    # the early lease's answer is admitted: its prompts were rendered again to check it
    receipt = _submit(job, early_batch)
    assert receipt.accepted and all(g.admitted for g in receipt.groups)
    ledger.close()
