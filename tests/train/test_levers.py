"""scripts/levers.py's table: an arm measured on other held-out prompts is refused, and each arm is charged what
its training text cost to write unless it wrote that text itself."""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def levers():
    spec = importlib.util.spec_from_file_location("levers", ROOT / "scripts" / "levers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(keys, alpha=(0.3, 0.2, 0.1), costs=()):
    return {"heldout_prompt_keys": keys, "alpha": list(alpha), "trained_tokens": 1000, "train_steps": 10,
            "training_text_cost": list(costs),
            "test": {"alpha": list(alpha), "tau_predicted": {"1": 1.3, "2": 1.36, "3": 1.38}, "num_tokens": 500}}


def test_an_arm_on_other_heldout_prompts_is_refused(tmp_path):
    m = levers()
    table = {"arms": {}}
    same = {"validation": ["a", "c"], "test": ["b", "d"]}
    m.add(table, m.row("base", "x", [], record(same), 60.0, 0.0, 70.0))
    m.add(table, m.row("loss-lk", "y", ["head.loss.kind=lk"], record(same, (0.35, 0.2, 0.1)), 60.0, 0.0, 70.0))
    other = {"validation": ["a", "c"], "test": ["b", "e"]}
    with pytest.raises(m.Refused, match="arm muon measured α on other held-out prompts"):
        m.add(table, m.row("muon", "z", [], record(other), 60.0, 0.0, 70.0))
    assert list(table["arms"]) == ["base", "loss-lk"]
    text = m.markdown({**table, "date": "d", "machine": m.machine(), "threads": 2, "commit": "c", "base": []})
    assert "| loss-lk |" in text and "+0.050" in text and "muon" not in text
    m.plot({**table, "date": "d", "machine": m.machine()}, tmp_path / "levers.png")
    assert (tmp_path / "levers.png").read_bytes()[:4] == b"\x89PNG"


def test_text_cost_is_charged_only_when_written_before_the_arm(tmp_path):
    m = levers()
    (tmp_path / "data").mkdir()
    old = tmp_path / "data" / "t-train-aa.cost.json"
    old.write_text(json.dumps({"cpu_seconds": 120.0}))
    os.utime(old, (time.time() - 100, time.time() - 100))
    new = tmp_path / "data" / "t-train-bb.cost.json"
    new.write_text(json.dumps({"cpu_seconds": 300.0}))
    start = time.time() - 50
    costs = [{"file": "t-train-aa.jsonl", "cpu_seconds": 120.0}, {"file": "t-train-bb.jsonl", "cpu_seconds": 300.0}]
    assert m.text_cpu_seconds(record({}, costs=costs), start, tmp_path) == 120.0  # bb: the arm's own getrusage
    with pytest.raises(m.Refused, match="no recorded cost"):
        m.text_cpu_seconds(record({}, costs=[{"file": "x.jsonl", "unknown": True}]), start, tmp_path)


def test_the_bf16_arm_is_refused_on_a_cpu_without_bf16_units():
    m = levers()
    with pytest.raises(m.Refused, match="arm bf16 needs a CPU with AMX or AVX512-BF16"):
        m.check_machine("bf16", {"cpu_units": ["avx2", "avx512f"]})
    m.check_machine("bf16", {"cpu_units": ["avx2", "avx512f", "avx512_bf16"]})
    m.check_machine("muon", {"cpu_units": ["avx2"]})
