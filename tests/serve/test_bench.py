"""scripts/bench.py --quick runs end to end and writes its three outputs (a smoke test, not a timing test)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.shared
def test_bench_quick(tmp_path):
    cmd = [sys.executable, "scripts/bench.py", "--quick", "--target", "tiny-random", "--threads", "1",
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
    """--gamma/--baselines (what scripts/bench_engines.py asks for): HF generate, vanilla and one γ-chain per head,
    still exact (greedy text equals HF's), with r(n) measured only where that chain reads it."""
    cmd = [sys.executable, "scripts/bench.py", "--quick", "--target", "tiny-random", "--threads", "1",
           "--untrained", "medusa", "eagle", "--gamma", "2", "--baselines", "hf_generate", "--out", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=900, capture_output=True)
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["method"]: r for r in report["results"]["0.0"]}
    assert set(rows) == {"hf_generate", "vanilla", "medusa (untrained): chain γ=2", "eagle (untrained): chain γ=2"}
    for name in ("medusa (untrained): chain γ=2", "eagle (untrained): chain γ=2"):
        assert rows[name]["setting"] == {"gamma": 2} and rows[name]["tau_measured"] >= 1.0
        assert rows[name]["tokens"] == rows["hf_generate"]["tokens"]
    assert all(sorted(map(int, c["r"])) == [1, 3] for c in report["costs"].values())
