"""Mid-run held-out α from cached features equals acceptance.measure's online α on the same head; the run keeps the
head of its best check (also across a crash and resume=true); val/trained_tokens counts every trained token."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.main import run
from train.module import DraftModule
from train.selection import read_state, score

ROOT = Path(__file__).resolve().parents[2]
TRAINING_STEP = DraftModule.training_step  # the real one, whatever a test patched in before


def val_rows(out: Path) -> list[dict]:
    """The CSV rows of mid-run checks, over every logger version (a resumed run starts a new one)."""
    rows = [r for f in sorted(out.glob("csv/version_*/metrics.csv")) for r in csv.DictReader(open(f))]
    return [r for r in rows if r.get("val/alpha@1")]


def test_midrun_alpha_equals_online_measure(fast_cfg, tmp_path, monkeypatch):
    """One check, at the last step: its α (cached features, a head pass) is the final measurement's (a target pass)."""
    seen = []
    original = DraftModule.validation_step

    def spy(self, batch, batch_idx):
        seen.append(f"hidden.{self.target.dims.num_layers}" in batch)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(DraftModule, "validation_step", spy)
    out = tmp_path / "run"
    record = run(fast_cfg("head=eagle3", "head.hparams.num_steps=3", "logger=csv", "head.loss.kind=kl",
                          "optim.lr=3e-3", "trainer.val_check_interval=8", "trainer.limit_val_batches=1.0",
                          out=out))
    assert seen and all(seen), "mid-run checks read the cached held-out features, no target pass"
    (row,) = val_rows(out)
    midrun = [float(row[f"val/alpha@{k}"]) for k in (1, 2, 3)]
    assert record["head_step"] == record["train_steps"] == 8 and midrun[0] > 0.05, (record, midrun)
    # the logger keeps float32; a single token is 1/num_tokens (> 1e-3) of α
    assert midrun == pytest.approx(record["alpha"], abs=1e-6)
    assert [float(row[f"val/tau@{g}"]) for g in (1, 2, 3)] == pytest.approx(
        [record["tau_predicted"][g] for g in (1, 2, 3)], abs=1e-6)
    (check,) = record["heldout_checks"]
    assert check["num_tokens"] == record["num_tokens"] and check["alpha"] == pytest.approx(record["alpha"], abs=1e-9)
    assert float(row["val/trained_tokens"]) == record["trained_tokens_total"] == record["trained_tokens"]


def falling(monkeypatch, crash_at: int | None = None):
    """After step 4 the head climbs the loss instead (held-out α falls); optionally crash at training call N."""
    calls = {"n": 0}

    def step(self, batch, batch_idx):
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise RuntimeError("simulated crash")
        loss = TRAINING_STEP(self, batch, batch_idx)
        return loss if self.trainer.global_step < 4 else -loss

    monkeypatch.setattr(DraftModule, "training_step", step)


@pytest.fixture
def falling_cfg(fast_cfg):
    return lambda out, *extra: fast_cfg("head=eagle3", "head.hparams.num_steps=3", "logger=csv", "head.loss.kind=kl",
                                        "optim.lr=3e-3", "optim.name=adamw", "trainer.max_steps=12", *extra, out=out)


def test_best_check_is_kept_when_alpha_falls(falling_cfg, tmp_path, monkeypatch):
    out = tmp_path / "run"
    falling(monkeypatch)
    record = run(falling_cfg(out))
    checks = record["heldout_checks"]
    assert [c["step"] for c in checks] == [4, 8, 12]
    assert max(checks, key=lambda c: score(c, "tau"))["step"] == 4, checks  # α fell after step 4
    assert record["head_step"] == 4 and record["train_steps"] == 12 and record["selected_by"] == "tau"
    assert record["alpha"] == pytest.approx(checks[0]["alpha"], abs=1e-9)  # OUT/head is the step-4 head
    assert record["alpha_last"] == pytest.approx(checks[-1]["alpha"], abs=1e-9)
    assert record["tau_predicted"][3] > record["tau_predicted_last"][3]
    state = read_state(out / "checkpoints")
    assert state["best"]["step"] == 4 and [p.name for p in (out / "checkpoints").glob("best-step*")] == \
        [state["best"]["dir"]]
    best, saved = (load_file(str(d / "model.safetensors")) for d in (out / "checkpoints" / state["best"]["dir"],
                                                                     out / "head"))
    assert all(torch.equal(best[k], saved[k]) for k in best)
    assert json.loads((out / "head" / "config.json").read_text())["train"]["steps"] == 4
    tokens = [float(r["val/trained_tokens"]) for r in val_rows(out)]
    assert tokens == [c["trained_tokens"] for c in checks] and tokens[0] < tokens[1] < tokens[2]
    assert tokens[2] == record["trained_tokens_total"] == record["trained_tokens"]

    # the scaling curve reads this run's CSV: one row per check, then the kept head
    proc = subprocess.run([sys.executable, "scripts/scaling_curve.py", str(out), "--out", str(tmp_path / "s.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| run ")
            and "step" not in line]
    assert [int(r[1]) for r in rows] == [4, 8, 12, 4] and int(rows[2][2].replace(",", "")) == tokens[2]
    assert float(rows[0][3]) == pytest.approx(checks[0]["alpha"][0], abs=1e-3)
    assert (tmp_path / "s.png").stat().st_size > 1000

    # a crash at step 10 (checkpoint at step 8, written before that step's check, at the end of epoch 0: 32 records
    # in batches of 4), then resume=true: the same batches follow, the step-4 head is still the one kept, and the
    # token count runs on from the checkpoint
    falling(monkeypatch, crash_at=10)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(falling_cfg(tmp_path / "resumed"))
    falling(monkeypatch)
    resumed = run(falling_cfg(tmp_path / "resumed", "resume=true"))
    assert resumed["head_step"] == 4 and [c["step"] for c in resumed["heldout_checks"]] == [4, 8, 12]
    assert resumed["trained_tokens_total"] == record["trained_tokens_total"] > resumed["trained_tokens"]
    again = load_file(str(tmp_path / "resumed" / "head" / "model.safetensors"))
    for k in saved:
        torch.testing.assert_close(again[k], saved[k], atol=1e-6, rtol=1e-5)


def test_state_pointing_at_a_missing_head_is_ignored(tmp_path):
    """kill -9 between writing a best head and pointing heldout.json at it cannot happen the other way round; a
    state file whose head is gone (deleted by hand) is not trusted."""
    (tmp_path / "heldout.json").write_text(json.dumps({"best_by": "tau", "best": {"dir": "best-step4.1"},
                                                       "history": [], "saves": 1}))
    assert read_state(tmp_path) is None
    (tmp_path / "best-step4.1").mkdir()
    (tmp_path / "best-step4.1" / "model.safetensors").write_bytes(b"x")
    assert read_state(tmp_path)["best"]["dir"] == "best-step4.1"
