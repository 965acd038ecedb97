"""mode=distill: sharded, resumable self-distillation. A kill -9 loses no record and duplicates none."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from heads.target import load_target
from train import UserError
from heads.records import read_sources
from train.regenerate import RegenConfig, regenerate

REPO = Path(__file__).resolve().parents[2]


def write_prompts(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            if i % 4 == 0:  # multi-turn: the target answers both turns
                f.write(json.dumps({"turns": [f"Tell me all about item {i}, in detail." * 3, "More."]}) + "\n")
            else:  # a dataset answer, dropped and replaced by the target's
                f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                 {"role": "assistant", "content": "someone else's answer"}]}) + "\n")
    return path


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(folder.glob("shard-*.jsonl")) for line in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-random")


def cfg(tmp_path, **kw) -> RegenConfig:
    base = dict(files=[str(write_prompts(tmp_path / "p.jsonl", 10))], shard_size=3, max_new_tokens=6,
                out_dir=str(tmp_path / "out"))
    return RegenConfig(**{**base, **kw})


def test_answers_every_prompt_once_with_turns_and_trainable_output(tmp_path, tiny):
    summary = regenerate(cfg(tmp_path, temperatures=[0.0, 1.0]), tiny)
    for name in ("t0", "t1"):
        got = rows(tmp_path / "out" / name)
        assert sorted(r["id"] for r in got) == sorted(f"{tmp_path / 'p.jsonl'}:{i}" for i in range(1, 11))
        multi = [r for r in got if "messages" in r]
        assert len(multi) == 3 and all([m["role"] for m in r["messages"]] == ["user", "assistant"] * 2 for r in multi)
        assert all("someone else's answer" not in json.dumps(r) for r in got)
        assert json.loads((tmp_path / "out" / name / "manifest.json").read_text())["records"] == 10
    assert summary["records"] == 10
    records = read_sources([str(tmp_path / "out" / "t0" / "shard-*.jsonl")])  # readable as training data
    assert len(records) == 10 and sum(r.token_ids is not None for r in records) == 7


def test_ranks_split_the_shards_and_a_rerun_skips_them(tmp_path, tiny):
    regenerate(cfg(tmp_path, rank=0, world_size=2), tiny)
    first = {p.name for p in (tmp_path / "out" / "t0").glob("shard-*.jsonl")}
    assert first == {"shard-00000.jsonl", "shard-00002.jsonl"}
    assert not (tmp_path / "out" / "t0" / "manifest.json").exists()  # rank 1 still owes its shards
    regenerate(cfg(tmp_path, rank=1, world_size=2), tiny)
    assert len({r["id"] for r in rows(tmp_path / "out" / "t0")}) == len(rows(tmp_path / "out" / "t0")) == 10
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "t0").glob("shard-*.jsonl")}
    regenerate(cfg(tmp_path), tiny)  # all done: nothing rewritten
    assert stamps == {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "t0").glob("shard-*.jsonl")}


def test_corrupt_shard_is_answered_again_and_other_settings_are_refused(tmp_path, tiny):
    regenerate(cfg(tmp_path), tiny)
    shard = tmp_path / "out" / "t0" / "shard-00001.jsonl"
    good = shard.read_text()
    shard.write_text(good[: len(good) // 2])  # a half-written file (e.g. copied while in flight)
    regenerate(cfg(tmp_path), tiny)
    assert shard.read_text() == good  # greedy: the same answers again
    with pytest.raises(UserError, match="other max_new_tokens.*delete it or set distill.out_dir"):
        regenerate(cfg(tmp_path, max_new_tokens=7), tiny)


def test_long_prompts_are_skipped_and_counted(tmp_path, tiny):
    regenerate(cfg(tmp_path, max_prompt_len=60), tiny)
    manifest = json.loads((tmp_path / "out" / "t0" / "manifest.json").read_text())
    assert manifest["records"] == 10 and manifest["skipped"] == 3  # the multi-turn prompts are the long ones
    assert len(read_sources([str(tmp_path / "out" / "t0" / "shard-*.jsonl")])) == 7


def test_a_larger_slice_copies_the_smaller_slices_shards_and_answers_only_the_rest(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    small = regenerate(cfg(tmp_path, out_dir=None, max_records=6, temperatures=[1.0]), tiny)  # 2 full shards of 3
    large = regenerate(cfg(tmp_path, out_dir=None, max_records=10, temperatures=[1.0]), tiny)  # shards of 3, 3, 3, 1
    assert small["out_dir"] != large["out_dir"]
    assert (large["datasets"]["t1"]["shards_copied"], large["datasets"]["t1"]["shards_answered"]) == (2, 2)
    for s in range(2):
        name = f"t1/shard-{s:05d}.jsonl"
        assert (Path(large["out_dir"]) / name).read_bytes() == (Path(small["out_dir"]) / name).read_bytes()
    # The copies are what answering them would have written: the same slice answered with no other cache around.
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "empty"))
    alone = regenerate(cfg(tmp_path, out_dir=None, max_records=10, temperatures=[1.0]), tiny)
    assert alone["datasets"]["t1"]["shards_copied"] == 0
    assert rows(Path(alone["out_dir"]) / "t1") == rows(Path(large["out_dir"]) / "t1")
    # Other settings, or other prompts, are never a donor.
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    other = regenerate(cfg(tmp_path, out_dir=None, max_records=10, temperatures=[1.0], max_new_tokens=7), tiny)
    reseeded = regenerate(cfg(tmp_path, out_dir=None, max_records=10, temperatures=[1.0], seed=1), tiny)
    assert other["datasets"]["t1"]["shards_copied"] == reseeded["datasets"]["t1"]["shards_copied"] == 0


@pytest.mark.slow
def test_kill_9_loses_and_duplicates_nothing(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out"
    cmd = [sys.executable, "train/main.py", "mode=distill", "target=tiny-random", "logger=none",
           f"distill.files=[{prompts}]", "distill.exclude_files=[]", "distill.shard_size=2", "distill.batch_size=2",
           "distill.max_new_tokens=32", f"distill.out_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(list((out / "t0").glob("shard-*.jsonl"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = {p: p.read_text() for p in (out / "t0").glob("shard-*.jsonl")}
    assert 2 <= len(done) < 12, f"the kill should land mid-run, found {len(done)} of 12 shards"
    assert not (out / "t0" / "manifest.json").exists()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=300, capture_output=True)
    assert all(p.read_text() == text for p, text in done.items())  # finished shards were kept, not redone
    ids = [r["id"] for r in rows(out / "t0")]
    assert sorted(ids) == sorted(f"{prompts}:{i}" for i in range(1, 25))  # none lost, none twice
    assert json.loads((out / "t0" / "manifest.json").read_text())["records"] == 24


def test_recipe_distils_caches_trains_and_reuses_both(compose, write_chat, tmp_path):
    from train.main import run

    prompts, heldout = write_prompts(tmp_path / "p.jsonl", 24), write_chat(tmp_path / "heldout.jsonl", n=6)
    reference = write_chat(tmp_path / "reference.jsonl", n=5, seed=3)  # answered records, trained on as written
    overrides = ("experiment=smollm2-eagle3", "target=tiny-random", "logger=none", f"distill.files=[{prompts}]",
                 "distill.exclude_files=[]", "distill.max_new_tokens=12", f"distill.out_dir={tmp_path / 'answers'}",
                 "distill.shard_size=8", f"data.eval_files=[{heldout}]", "data.max_eval_records=null",
                 f"data.reference_files=[{reference}]", f"data.feature_dir={tmp_path / 'feats'}",
                 "trainer.max_steps=4", "head.hparams.draft_vocab_size=128",
                 # the recipe's bf16-if-faster times both precisions: on this toy target both take ~0.01 s a step, so
                 # a loaded machine picked bf16 in one run and fp32 in the other, and the heads differed
                 "trainer.precision=32-true")
    first = run(compose(tmp_path / "run1", *overrides))
    assert first["feature_cache"]["shards_built"] >= 1 and len(first["alpha"]) == 3
    assert first["trained_tokens"] > 0 and first["trained_tokens_per_s"] > 0
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "answers").rglob("*.jsonl")}
    second = run(compose(tmp_path / "run2", *overrides))  # answers and features come from disk
    assert second["feature_cache"]["shards_built"] == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in (tmp_path / "answers").rglob("*.jsonl")}
    assert_same_head(tmp_path / "run1", tmp_path / "run2", first, second)  # cached or made, the same head


def assert_same_head(run1: Path, run2: Path, first: dict, second: dict):
    """The two runs saved byte-identical heads and measured the same α."""
    heads = [sorted((run / "head").glob("*.safetensors")) for run in (run1, run2)]
    assert heads[0] and [p.name for p in heads[0]] == [p.name for p in heads[1]]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(*heads))
    assert first["alpha"] == second["alpha"]


def test_an_unknown_engine_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^distill.engine='sglang'; choose one of builtin, vllm$"):
        RegenConfig(files=["x"], engine="sglang")


@pytest.mark.slow
def test_first_run_after_install_trains_the_rerun_s_head(compose, write_chat, tmp_path, monkeypatch):
    """SmolLM2 from an empty cache: the GGUF is converted (transformers builds a randomly initialised model first,
    drawing on torch's generator) and the prompts answered; the rerun does neither. Both must train the same head."""
    from train.main import run

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    prompts, heldout = write_prompts(tmp_path / "p.jsonl", 8), write_chat(tmp_path / "heldout.jsonl", n=4)
    overrides = ("experiment=smollm2-eagle3", "target=smollm2-135m", "logger=none", f"distill.files=[{prompts}]",
                 "distill.exclude_files=[]", "distill.max_new_tokens=8", "distill.shard_size=4",
                 "data.distill.max_new_tokens=8", f"data.eval_files=[{heldout}]", "data.max_eval_records=null",
                 "data.reference_files=[]", "trainer.max_steps=3", "trainer.val_check_interval=3",
                 "head.hparams.draft_vocab_size=64", "eval.extra_temperatures=[]",
                 "trainer.precision=32-true")  # one precision in both runs, whatever bf16-if-faster would time
    first = run(compose(tmp_path / "run1", *overrides))
    assert (tmp_path / "cache" / "targets").is_dir() and first["feature_cache"]["shards_built"] >= 1
    second = run(compose(tmp_path / "run2", *overrides))
    assert second["feature_cache"]["shards_built"] == 0
    assert_same_head(tmp_path / "run1", tmp_path / "run2", first, second)
