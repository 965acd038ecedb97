"""`python -m bench allocator`: each arm is its own training process under its own setting, and the result holds
every run's throughput and rusage beside the ratios."""
from __future__ import annotations

import json

import pytest

from bench.__main__ import main

pytestmark = pytest.mark.slow


def chat(path, n):
    """Answered chat records of our own text: tiny-random trains on them without self-distillation."""
    rows = [{"messages": [{"role": "user", "content": f"Tell me about item {i}."},
                          {"role": "assistant", "content": f"Item {i} is a small thing. " * (2 + i % 3)}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_allocator_runs_each_arm_as_a_training_process(tmp_path):
    train_file, eval_file = chat(tmp_path / "train.jsonl", 32), chat(tmp_path / "heldout.jsonl", 8)
    main(["allocator", "--reps", "1", "--arms", "glibc", "keep", "--out", str(tmp_path / "out"), "target=tiny-random",
          "trainer.max_steps=4", "trainer.val_check_interval=4", "data.batch_size=4",
          f"data.train_files=[{train_file}]", f"data.eval_files=[{eval_file}]", "trainer.precision=32"])
    report = json.loads((tmp_path / "out" / "allocator.json").read_text())
    assert set(report["runs"]) == {"glibc", "keep"} and all(len(r) == 1 for r in report["runs"].values())
    for r in report["best"].values():
        # a real process trained: tokens went through the loss, and its own CPU time, faults and memory were counted
        assert r["trained_tokens_per_s"] > 0 and r["user_s"] > 0.5 and r["minor_faults"] > 1000
        assert 0.1 < r["peak_rss_gib"] < 16
    assert report["over_first"]["glibc"] == 1.0
    assert report["over_first"]["keep"] == pytest.approx(report["best"]["keep"]["trained_tokens_per_s"]
                                                         / report["best"]["glibc"]["trained_tokens_per_s"])
    assert report["arms"]["keep"]["overrides"] == ["keep_freed_memory=true"] and report["thp_mode"]
    table = (tmp_path / "out" / "allocator.md").read_text()
    assert "| keep | `keep_freed_memory=true` |" in table and report["machine"]["cpu"] in table
