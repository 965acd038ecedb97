"""`python -m bench`: every subcommand is reachable, shares bench/common.py's arguments and record, and writes its
JSON result beside its markdown table; bad input is one line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import common
from bench.__main__ import SUBCOMMANDS, main, parser

ROOT = common.ROOT


def test_every_subcommand_is_listed_and_parses():
    proc = subprocess.run([sys.executable, "-m", "bench", "-h"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert set(SUBCOMMANDS) == {"decode", "adaptive", "engines", "step", "distill", "vocab", "feature-cache",
                                "allocator"}
    for name in SUBCOMMANDS:
        assert name in proc.stdout
    p = parser()
    for argv in (["step", "--threads", "1", "--reps", "3"], ["decode", "--max-new-tokens", "7", "--compile"],
                 ["engines", "--eagle3", "x", "--threads", "1"], ["adaptive", "--reps", "4", "--limit", "3"]):
        args = p.parse_args(argv + (["--heads", "h"] if argv[0] == "adaptive" else []))
        for flag, value in zip(argv[1::2], argv[2::2]):
            assert str(getattr(args, flag.lstrip("-").replace("-", "_"))) == value
    assert p.parse_args(["decode", "--compile"]).compile is True
    assert p.parse_args(["step"]).reps == 7 and p.parse_args(["adaptive", "--heads", "h"]).reps == 2  # own defaults


def test_record_and_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "__main__.py"), "step", "--reps", "1"])
    report = common.record(rows=[1])
    assert report["command"] == "python -m bench step --reps 1"
    m = report["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["threads"] >= 1 and m["torch"]
    assert set(m["cpu_units"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert m["cpu"] in common.machine_line(m)
    (tmp_path / "x.json").write_text("old")
    common.write(tmp_path, "x", report, "# table\n")
    assert json.loads((tmp_path / "x.json").read_text())["rows"] == [1]
    assert (tmp_path / "x.md").read_text() == "# table\n" and not (tmp_path / "x.json.tmp").exists()


def test_best_of_interleaves_and_keeps_the_fastest():
    calls = []

    def slow(i):
        calls.append(("slow", i))

    def fast(i):
        calls.append(("fast", i))

    best = common.best_of({"slow": slow, "fast": fast}, [1, 2], reps=2)
    # one warm-up each, then per round every method over every item, methods alternating
    assert calls[:4] == [("slow", 1), ("slow", 2), ("fast", 1), ("fast", 2)]
    assert calls[4:8] == calls[:4] and calls[8:] == calls[:4] and len(calls) == 12
    assert set(best) == {"slow", "fast"} and all(0 <= t < 1 for r in best.values() for t in r.values())


def test_step_on_a_real_tiny_target_writes_json_beside_markdown(tmp_path):
    main(["step", "--target", "tiny-random", "--threads", "1", "--reps", "1", "--sizes", "1", "2", "--context", "16",
          "--skip", "hf", "bound", "x-wt", "llama", "--no-bf16", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "step.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"serve"} and rows["serve"]["step_ms"] > 0 and rows["serve"]["r(2)"] > 0
    assert report["machine"]["threads"] == 1 and report["sizes"] == [1, 2]
    table = (tmp_path / "step.md").read_text()
    assert "| serve |" in table and report["machine"]["cpu"] in table


def test_bad_input_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "engines", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: no heads: pass at least one of --eagle3/--eagle/--medusa DIR"]
    with pytest.raises(SystemExit):
        parser().parse_args(["nonsense"])
