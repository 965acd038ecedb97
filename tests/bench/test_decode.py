"""`python -m bench decode --quick` runs end to end and writes its three outputs (a smoke test, not a timing test); its
prediction comes from acceptance.json alone, and it refuses prompts the head's α was measured on."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from heads.checkpoint import save_head
from heads.splits import assign_splits, prompt_key
from heads.target import shared_dir
from tests.serve.conftest import perturbed_head, runner_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.shared
def test_bench_quick(tmp_path):
    cmd = [sys.executable, "-m", "bench", "decode", "--quick", "--target", "tiny-random", "--threads", "1",
           "--untrained", "medusa", "eagle", "--out", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=900, capture_output=True)
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["method"]: r for r in report["results"]["0.0"]}
    assert {"hf_generate", "hf_prompt_lookup", "hf_early_exit", "vanilla"} <= set(rows)
    assert any(m.startswith("medusa") and "tree" in m for m in rows) and any("dynamic tree" in m for m in rows)
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["tokens"] > 0
    assert rows["hf_generate"]["tokens"] == rows["vanilla"]["tokens"]  # same greedy text, same stops
    assert (tmp_path / "bench.md").read_text().count("|") > 20 and (tmp_path / "bench.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.shared
def test_bench_fixed_gamma_is_one_chain_per_head(tmp_path):
    """--gamma/--baselines (what `bench engines` asks for): HF generate, vanilla and one γ-chain per head,
    still exact (greedy text equals HF's), with r(n) measured only where that chain reads it."""
    cmd = [sys.executable, "-m", "bench", "decode", "--quick", "--target", "tiny-random", "--threads", "1",
           "--untrained", "medusa", "eagle", "--gamma", "2", "--baselines", "hf_generate", "--out", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=900, capture_output=True)
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["method"]: r for r in report["results"]["0.0"]}
    assert set(rows) == {"hf_generate", "vanilla", "medusa (untrained): chain γ=2", "eagle (untrained): chain γ=2"}
    for name in ("medusa (untrained): chain γ=2", "eagle (untrained): chain γ=2"):
        # a chain reaches step 2 exactly when step 1 is kept: τ = 1 + r1 + r1 r2 from the row's own rates
        r1, r2 = rows[name]["accept_rate_per_position"]
        assert rows[name]["setting"] == {"gamma": 2}
        assert rows[name]["tau_measured"] == pytest.approx(1 + r1 + r1 * (r2 or 0.0)), rows[name]
        assert rows[name]["tokens"] == rows["hf_generate"]["tokens"]
    assert rows["medusa (untrained): chain γ=2"]["accept_rate_per_position"][0] > 0  # one row is not 1 = 1 + 0
    assert all(sorted(map(int, c["r"])) == [1, 3] for c in report["costs"].values())


def spec_bench_keys() -> dict[str, list[str]]:
    rows = [json.loads(line) for line in (shared_dir() / "data/eval/spec_bench/question.jsonl").read_text().splitlines()]
    keys = {"validation": [], "test": []}
    for row, split in zip(rows, assign_splits(r["category"] for r in rows)):
        keys[split].append(prompt_key(row["turns"][0]))
    return keys


def head_with_acceptance(tiny_target, path: Path, alpha: list[float], keys: dict) -> Path:
    """A perturbed EAGLE head of the tiny target, with an acceptance.json that says what we want it to."""
    head = perturbed_head("eagle", tiny_target, runner_model(tiny_target), std=0.5)
    save_head(head, path / "head", tiny_target.identity())
    (path / "acceptance.json").write_text(json.dumps({"alpha": alpha, "temperature": 0.0, "split": "validation",
                                                      "heldout_prompt_keys": keys}))
    return path


def run_bench(path: Path, out: Path, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench", "decode", "--quick", "--target", "tiny-random", "--threads", "1",
           "--heads", str(path), "--gamma", "3", "--baselines", "hf_generate", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, timeout=900, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.shared
def test_bench_prediction_comes_from_acceptance_json_not_the_run(tiny_target, tmp_path):
    """A head that claims α = 0.99 but drafts noise: the prediction (from acceptance.json) and the measurement
    part ways. A prediction built from the run's own acceptance per position would agree with it by construction."""
    keys = spec_bench_keys()
    path = head_with_acceptance(tiny_target, tmp_path / "liar", [0.99, 0.99, 0.99], {"validation": keys["validation"]})
    res = run_bench(path, tmp_path / "out")
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["split"] == "test" and report["prompts_unseen_by_alpha"] == {"eagle": "unseen"}
    row = next(r for r in report["results"]["0.0"] if r["method"].startswith("eagle"))
    assert row["tau_predicted_from_alpha"] == pytest.approx(1 + 0.99 + 0.99 ** 2 + 0.99 ** 3, rel=1e-6)
    assert row["tau_measured"] < 2.0 < row["tau_predicted_from_alpha"]  # noise is rarely accepted
    assert row["measured_over_predicted"] < 0.8


@pytest.mark.slow
@pytest.mark.shared
def test_bench_refuses_prompts_the_heads_alpha_was_measured_on(tiny_target, tmp_path):
    keys = spec_bench_keys()
    assert not set(keys["validation"]) & set(keys["test"]) and len(keys["test"]) == 240
    path = head_with_acceptance(tiny_target, tmp_path / "seen", [0.5, 0.4, 0.3], {"validation": keys["test"]})
    res = run_bench(path, tmp_path / "out")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "the text" in res.stderr and "Traceback" not in res.stderr
