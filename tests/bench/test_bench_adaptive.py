"""`python -m bench adaptive` end to end on the tiny target's EAGLE head (acceptance.json beside it): every method on
the same prompts, ratios against plain and the best fixed setting, adaptive.json beside adaptive.md."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.common import ROOT
from tests.serve.conftest import write_heads_and_prompts


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_target):
    return write_heads_and_prompts(tmp_path_factory.mktemp("adaptive"), tiny_target, ("eagle",))


def run_bench_adaptive(files, out, *args) -> dict:
    """`bench adaptive` on the tiny target's EAGLE head, 3 prompts, one rep; its adaptive.json."""
    cmd = [sys.executable, "-m", "bench", "adaptive", "--target", "tiny-random", "--heads", str(files / "eagle"),
           "--prompts", str(files / "prompts.jsonl"), "--split", "all", "--limit", "3", "--reps", "1", "--threads", "1",
           "--out", str(out), *args]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600, capture_output=True)
    return json.loads((out / "adaptive.json").read_text())


@pytest.mark.slow
def test_bench_adaptive_compares_every_method_with_plain_and_the_best_fixed(files, tmp_path):
    """`bench adaptive` end to end on a tiny target: plain, each fixed chain, auto's tree and both adaptive
    modes on the same prompts; "best fixed" is the fastest fixed setting and every ratio is against plain's rate."""
    report = run_bench_adaptive(files, tmp_path, "--max-new-tokens", "12", "--temperatures", "0")
    (result,) = report["results"]
    rows = {r["method"]: r for r in result["rows"]}
    assert {"plain", "chain γ=1", "chain γ=2", "chain γ=3", "adaptive γ", "adaptive dynamic tree"} <= set(rows)
    assert any("dynamic tree" in m and not m.startswith("adaptive") for m in rows)
    assert {r["tokens"] for r in rows.values()} == {rows["plain"]["tokens"]} and rows["plain"]["tokens"] > 0
    fixed = [r for m, r in rows.items() if m != "plain" and not m.startswith("adaptive")]
    best = max(fixed, key=lambda r: r["tokens_per_s"])
    assert [r["method"] for r in rows.values() if r["best_fixed"]] == [best["method"]]
    for r in rows.values():
        assert r["x_plain"] == pytest.approx(r["tokens_per_s"] / rows["plain"]["tokens_per_s"])
        assert r["x_best_fixed"] == pytest.approx(r["tokens_per_s"] / best["tokens_per_s"])
    assert all(sum(rows[m]["rounds_by_setting"].values()) > 0 for m in ("adaptive γ", "adaptive dynamic tree"))
    assert "| adaptive γ |" in (tmp_path / "adaptive.md").read_text()


@pytest.mark.slow
def test_bench_adaptive_ignore_eos_gives_every_sampled_method_the_same_length(files, tmp_path):
    """At T = 1 each method samples its own text; with --ignore-eos each decodes exactly --max-new-tokens per prompt,
    so no method's tokens/s carries a shorter request's larger share of prefill."""
    report = run_bench_adaptive(files, tmp_path, "--max-new-tokens", "20", "--temperatures", "1", "--ignore-eos")
    assert report["ignore_eos"] and "end-of-turn ignored" in (tmp_path / "adaptive.md").read_text()
    assert {r["tokens"] for r in report["results"][0]["rows"]} == {3 * 20}
