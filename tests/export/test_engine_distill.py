"""distill.engine=vllm: the target answers mode=distill's prompts through vLLM, into the same shards.

The built-in loop is the reference: at T = 0 vLLM's answers must be the built-in loop's greedy answers token for
token (both float32), multi-turn records must come back as conversations, and at T = 1 the answers must be samples
(not the greedy text) that follow the seeds: the same run twice gives the same shards.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_helpers import PROMPTS, engine_env
from heads.target import load_target
from train.distill import DistillConfig, prompt_ids, sample, stop_ids
from train.regenerate import RegenConfig, regenerate, select

pytestmark = [pytest.mark.engine, pytest.mark.slow]
MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    with open(path, "w") as f:
        for p in PROMPTS:  # single-turn, with an answer that must be replaced
            f.write(json.dumps({"messages": [{"role": "user", "content": p},
                                             {"role": "assistant", "content": "someone else's answer"}]}) + "\n")
        f.write(json.dumps({"turns": ["Name a fruit.", "And a vegetable?"]}) + "\n")  # multi-turn
    return path


def run(prompts_file: Path, out: Path, target, temperatures: list[float]) -> dict[float, list[dict]]:
    """regenerate() through vLLM (one worker for all temperatures): {T: the shards' rows}."""
    cfg = RegenConfig(files=[str(prompts_file)], temperatures=temperatures, max_new_tokens=MAX_NEW, shard_size=4,
                      batch_size=4, out_dir=str(out), engine="vllm")
    assert regenerate(cfg, target)["engine"] == "vllm"
    rows = {}
    for t in temperatures:
        folder = out / f"t{t:g}"
        assert json.loads((folder / "manifest.json").read_text())["records"] == len(PROMPTS) + 1
        rows[t] = [json.loads(line) for p in sorted(folder.glob("shard-*.jsonl")) for line in p.read_text().splitlines()]
    return rows


@pytest.fixture(scope="module")
def vllm_rows(prompts_file, target, tmp_path_factory):
    engine_env("vllm")  # skips (fails under REQUIRE_ENGINES=1) when the venv cannot be built
    out = tmp_path_factory.mktemp("vllm")
    both = run(prompts_file, out / "a", target, [0.0, 1.0])
    return {"greedy": both[0.0], "sampled": both[1.0], "sampled_again": run(prompts_file, out / "b", target, [1.0])[1.0]}


def test_greedy_answers_equal_the_builtin_loops(vllm_rows, prompts_file, target):
    records = select(RegenConfig(files=[str(prompts_file)]))
    single = [r for r in records if not r.followups]
    builtin, _ = sample(target.model, [prompt_ids(r, target.tokenizer) for r in single],
                        DistillConfig(max_new_tokens=MAX_NEW, temperature=0.0, batch_size=4), stop_ids(target),
                        target.tokenizer.pad_token_id)
    by_prompt = {tuple(r["prompt_ids"]): r["token_ids"] for r in vllm_rows["greedy"] if "token_ids" in r}
    assert len(by_prompt) == len(single)
    for r, want in zip(single, builtin):
        assert by_prompt[tuple(prompt_ids(r, target.tokenizer))] == want


def test_multi_turn_records_come_back_as_conversations(vllm_rows):
    multi = [r for r in vllm_rows["greedy"] if "messages" in r]
    assert len(multi) == 1
    roles = [m["role"] for m in multi[0]["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"] and all(m["content"] for m in multi[0]["messages"])
    assert all("someone else's answer" not in json.dumps(r) for r in vllm_rows["greedy"])


def test_sampled_answers_are_samples_that_follow_the_seeds(vllm_rows):
    greedy = {tuple(r["prompt_ids"]): r["token_ids"] for r in vllm_rows["greedy"] if "token_ids" in r}
    sampled = {tuple(r["prompt_ids"]): r["token_ids"] for r in vllm_rows["sampled"] if "token_ids" in r}
    assert sum(sampled[k] != greedy[k] for k in greedy) >= len(greedy) // 2, "T=1 answers look greedy"
    assert vllm_rows["sampled"] == vllm_rows["sampled_again"], "the same seeds must give the same samples"
    assert all(0 < len(v) <= MAX_NEW for v in sampled.values())
