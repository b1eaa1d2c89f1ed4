"""Data-set tasks: the loader and its one-line errors, the seed split, rendering, content
addressing and chunk-by-chunk transfer (a tampered chunk is refused)."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from swarmrl.node.swarm.datasets import DatasetFetchStats, DatasetStore, DatasetUnavailable, fetch_dataset
from swarmrl.node.tasks.job_file import load_job_file
from swarmrl.protocol.blobs import BlobAssembler, BlobError, assemble_blob, blob_chunks
from swarmrl.protocol.envs import HELDOUT_START, job_environment
from swarmrl.protocol.envs.dataset import (
    DATASET_CHUNK_BYTES,
    DatasetEnv,
    DatasetTask,
    chunk_hashes,
    parse_rows,
    split_rows,
)
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

ROWS = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(40)]
REWARDS = '[{name = "math_verify", weight = 1.0}, {name = "regex_format", weight = 0.1, pattern = \'^\\s*-?\\d+\\s*$\'}]'


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def write_job(tmp: Path, data: bytes, extra: str = "", env: str = "", name: str = "tasks.jsonl") -> Path:
    (tmp / name).write_bytes(data)
    env = env or f'dataset = "{name}"\nprompt_field = "question"\nanswer_field = "answer"\nrewards = {REWARDS}\n'
    job = tmp / "job.toml"
    job.write_text(f'base_model = "tiny"\nsteps = 2\n{extra}\n[environment]\n{env}')
    return job


def test_job_file_pins_the_data_set(tmp_path: Path, model_cache: Path) -> None:
    data = jsonl(ROWS)
    loaded = load_job_file(write_job(tmp_path, data), model_cache)
    task = loaded.spec.dataset
    assert task is not None and loaded.dataset == data
    assert task.dataset == "tasks.jsonl" and task.dataset_sha256 == hashlib.sha256(data).hexdigest()
    assert task.dataset_size == len(data) and task.dataset_chunks == chunk_hashes(data)
    assert loaded.report.rows == 40 and loaded.report.train_rows + loaded.report.heldout_rows == 40
    again = JobSpec.from_json(loaded.spec.canonical_json())   # the wire form round-trips
    assert again == loaded.spec and again.environment_id == f"dataset:{task.dataset_sha256[:16]}"


def test_string_environment_still_means_installed(tmp_path: Path, model_cache: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('base_model = "tiny"\nenvironment = "arithmetic"\n')
    loaded = load_job_file(job, model_cache)
    assert loaded.spec.environment == "arithmetic" and loaded.dataset is None


BAD_CASES = [
    ("empty file", b"", "", "the file is empty"),
    ("blank lines only", b"\n\n", "", "the file is empty"),
    ("not utf-8", jsonl(ROWS[:3]) + b'{"question": "\xff\xfe", "answer": "1"}\n', "", "line 4 is not UTF-8"),
    ("not json", jsonl(ROWS[:2]) + b"{oops\n", "", "line 3 is not JSON"),
    ("not an object", b"[1, 2]\n", "", "line 1 is a JSON list"),
    ("misspelt field", jsonl(ROWS), "", None),
    ("field missing in some rows", jsonl(ROWS[:5] + [{"question": "q"}] * 2 + ROWS[5:]), "",
     "field 'answer' missing in rows 6-7 (2 of 42)"),
    ("empty prompt", jsonl(ROWS[:3] + [{"question": " ", "answer": "1"}]), "", "field 'question' is empty"),
    ("prompt too long", jsonl(ROWS[:3] + [{"question": "x " * 400, "answer": "1"}] + ROWS[3:]),
     "max_prompt_tokens = 64", "row 4 renders to"),
]


@pytest.mark.parametrize(("case", "data", "extra", "message"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_data_sets_fail_in_one_line(tmp_path: Path, model_cache: Path, case: str, data: bytes, extra: str,
                                        message: str | None) -> None:
    env = ""
    if case == "misspelt field":
        env = f'dataset = "tasks.jsonl"\nprompt_field = "questoin"\nanswer_field = "answer"\nrewards = {REWARDS}\n'
        message = "field 'questoin' missing in all rows; did you mean 'question'?"
    with pytest.raises(ValueError) as err:
        load_job_file(write_job(tmp_path, data, extra, env), model_cache)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("rewards", "message"), [
    ('[{name = "math_verfy"}]', "unknown reward 'math_verfy'"),
    ('[{name = "regex_format", pattern = "(unclosed"}]', "bad pattern"),
    ("[]", "rewards"),
])
def test_bad_rewards_fail_at_submit(tmp_path: Path, model_cache: Path, rewards: str, message: str) -> None:
    env = f'dataset = "tasks.jsonl"\nprompt_field = "question"\nanswer_field = "answer"\nrewards = {rewards}\n'
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_job_file(write_job(tmp_path, jsonl(ROWS), "", env), model_cache)


def test_oversized_file_and_duplicates(tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_job_file(write_job(tmp_path, jsonl(ROWS + ROWS[:3])), model_cache)
    assert loaded.report.duplicates == 3 and "3 duplicate rows" in loaded.report.warnings[0]
    from swarmrl.node.tasks import job_file as tasks
    monkeypatch.setattr(tasks, "MAX_DATASET_BYTES", 100)
    with pytest.raises(ValueError, match="over the 0 MiB limit"):
        load_job_file(write_job(tmp_path, jsonl(ROWS)), model_cache)


def test_parquet_rows(tmp_path: Path) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), buf)
    assert parse_rows(buf.getvalue(), "parquet") == ROWS[:4]
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        parse_rows(b"not parquet", "parquet")


def _env(seed: int = 0, data: bytes | None = None, **kw) -> DatasetEnv:
    data = data if data is not None else jsonl(ROWS)
    task = DatasetTask(dataset="t.jsonl", dataset_sha256=hashlib.sha256(data).hexdigest(), dataset_size=len(data),
                       dataset_chunks=chunk_hashes(data), prompt_field="question", answer_field="answer",
                       rewards=[{"name": "exact_match"}], **kw)
    return DatasetEnv(task, data, seed)


def test_seed_split_is_deterministic_disjoint_and_seed_dependent() -> None:
    a, b, c = _env(0), _env(0), _env(1)
    train_a = [r["question"] for r in a.train_rows]
    held_a = [r["question"] for r in a.heldout_rows]
    assert train_a == [r["question"] for r in b.train_rows]
    assert not set(train_a) & set(held_a) and len(train_a) + len(held_a) == 40
    assert train_a != [r["question"] for r in c.train_rows]
    # duplicated prompts land on the same side
    train, held = split_rows(ROWS + ROWS, "question", 0, 0.25)
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    # train indices cycle the train split, held-out indices the held-out split
    n = len(a.train_rows)
    assert a.prompt(0, 3).text == a.prompt(0, 3 + n).text
    assert a.prompt(0, HELDOUT_START).text in held_a
    with pytest.raises(ValueError, match="split with seed 0"):
        a.prompt(1, 0)


def test_copies_of_a_prompt_share_a_side_and_are_spread_through_its_order() -> None:
    rows = [r for r in ROWS[:8] for _ in range(5)]   # each prompt 5 times, copies adjacent in the file
    train, held = split_rows(rows, "question", 0, 0.25)
    assert len(train) + len(held) == 40 and not {r["question"] for r in train} & {r["question"] for r in held}
    adjacent = sum(a["question"] == b["question"] for side in (train, held) for a, b in itertools.pairwise(side))
    assert adjacent < 10   # 32 of 38 neighbour pairs were copies when the order was the side's hash
    assert split_rows(rows, "question", 0, 0.25) == (train, held)


def test_rendering_plain_and_chat_turns() -> None:
    env = _env(system_prompt="Be brief.", prompt_template="Q: {prompt}\nA:",
               few_shot=[{"prompt": "1+1", "answer": "2"}])
    p = env.prompt(0, 0)
    question = p.messages[-1][1]
    assert p.text == f"Be brief.\n\nQ: 1+1\nA: 2\n{question}"
    assert p.messages[:3] == (("system", "Be brief."), ("user", "Q: 1+1\nA:"), ("assistant", "2"))
    assert p.info == {"answer": next(r["answer"] for r in ROWS if f"Q: {r['question']}\nA:" == question)}


def test_job_environment_refuses_other_bytes() -> None:
    env = _env()
    spec_task = env.task
    other = jsonl(ROWS[:10])
    with pytest.raises(ValueError, match="do not match the job's sha256"):
        DatasetEnv(spec_task, other, 0)

    class Spec:
        dataset = spec_task
        seed = 0
    with pytest.raises(ValueError, match="not available here"):
        job_environment(Spec(), None)


# ---- content addressing and chunked transfer

BIG = jsonl(ROWS) * (2 * DATASET_CHUNK_BYTES // len(jsonl(ROWS)) + 1)   # 3 chunks


def _task(data: bytes) -> DatasetTask:
    return DatasetTask(dataset="big.jsonl", dataset_sha256=hashlib.sha256(data).hexdigest(), dataset_size=len(data),
                       dataset_chunks=chunk_hashes(data), prompt_field="question", answer_field="answer",
                       rewards=[{"name": "exact_match"}])


def test_chunks_round_trip() -> None:
    chunks = list(blob_chunks(BIG))
    assert len(chunks) == 3 and chunks[-1].last and not chunks[0].last
    task = _task(BIG)
    assert assemble_blob(iter(chunks), task.dataset_sha256, task.dataset_size, task.dataset_chunks) == BIG


def test_a_tampered_chunk_is_refused_at_that_chunk() -> None:
    task = _task(BIG)
    chunks = list(blob_chunks(BIG))
    chunks[1] = pb.AdapterChunk(data=b"X" + bytes(chunks[1].data)[1:], last=False)
    asm = BlobAssembler(task.dataset_sha256, task.dataset_size, task.dataset_chunks)
    asm.add(chunks[0])
    with pytest.raises(BlobError, match="chunk 1: sha256 mismatch"):
        asm.add(chunks[1])
    with pytest.raises(BlobError, match="ended after 2 of 3"):
        assemble_blob(iter(list(blob_chunks(BIG))[:2]), task.dataset_sha256, task.dataset_size, task.dataset_chunks)
    extra = [*blob_chunks(BIG)]
    extra[-1] = pb.AdapterChunk(data=extra[-1].data, last=False)
    with pytest.raises(BlobError, match="more chunks"):
        assemble_blob(iter([*extra, pb.AdapterChunk(data=b"x", last=True)]), task.dataset_sha256,
                      task.dataset_size, task.dataset_chunks)


def test_fetch_refuses_a_lying_source_counts_it_and_caches_the_good_copy(tmp_path: Path) -> None:
    task = _task(BIG)
    store = DatasetStore(tmp_path / "datasets")
    stats = DatasetFetchStats()
    bad = [pb.AdapterChunk(data=bytes(c.data)[::-1], last=c.last) for c in blob_chunks(BIG)]
    with pytest.raises(DatasetUnavailable, match="refused"):
        fetch_dataset(task, store, trainer=SimpleNamespace(fetch_dataset=lambda req: iter(bad)), stats=stats, trainer_name="liar")
    assert stats.refused["liar"] == 1 and store.get(task.dataset_sha256) is None
    got = fetch_dataset(task, store, trainer=SimpleNamespace(fetch_dataset=lambda req: blob_chunks(BIG)), stats=stats)
    assert got == BIG and stats.sources["trainer"] == 1
    assert fetch_dataset(task, store, trainer=None, stats=stats) == BIG and stats.sources["cache"] == 1
    store.path(task.dataset_sha256).write_bytes(b"corrupt")
    assert store.get(task.dataset_sha256) is None   # re-hashed on read, removed


def test_an_empty_split_says_the_distinct_prompts_and_what_to_change(tmp_path: Path, model_cache: Path) -> None:
    """60 rows of 20 distinct questions were refused with "60 rows leave an empty train or held-out
    split; add rows" (issue 28 item 4): say how many distinct prompts, how many the fraction holds
    out, and what to change; the seed it suggests then loads."""
    rows = [ROWS[i % 20] for i in range(60)]
    seed = next(s for s in range(100) if not split_rows(rows, "question", s, 0.1)[1])
    with pytest.raises(ValueError) as err:
        load_job_file(write_job(tmp_path, jsonl(rows), f"seed = {seed}"), model_cache)
    message = str(err.value)
    assert "\n" not in message, message
    assert (f"60 rows hold 20 distinct prompts (copies of a prompt stay on one side); heldout_fraction 0.1 holds "
            f"out 0 of them with seed {seed} (about 2.0 on average), leaving no held-out prompt") in message
    assert "about 30 distinct prompts" in message and "heldout_fraction to 0.15" in message
    suggested = int(message.split("set seed = ")[1].split()[0])
    loaded = load_job_file(write_job(tmp_path, jsonl(rows), f"seed = {suggested}"), model_cache)
    assert loaded.report.heldout_rows > 0 and loaded.report.train_rows > 0
