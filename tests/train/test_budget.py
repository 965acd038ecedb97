"""budget.minutes: training stops at the steps that fit before the deadline, with the LR schedule sized to them, on a
clock the test moves by one second per training step (no timing of this machine)."""
from __future__ import annotations

import csv
import time
from types import SimpleNamespace

import pytest

import train.budget
import train.main
from train import UserError
from train.budget import steps_that_fit
from train.main import run
from train.module import DraftModule


class StepClock:
    """time.monotonic for train/main.py and train/budget.py: 0 at the job's start, +1 s per training step."""

    def __init__(self):
        self.t = 0.0
        self.slow_steps, self.slow_seconds = 0, 1.0  # the first slow_steps steps take slow_seconds each
        self.steps = 0

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def step_clock(monkeypatch):
    clock = StepClock()
    fake_time = SimpleNamespace(monotonic=clock.monotonic, perf_counter=time.perf_counter)
    monkeypatch.setattr(train.main, "time", fake_time)
    monkeypatch.setattr(train.budget, "time", fake_time)
    original = DraftModule.training_step

    def one_second_step(self, batch, batch_idx):
        clock.steps += 1
        clock.t += clock.slow_seconds if clock.steps <= clock.slow_steps else 1.0
        return original(self, batch, batch_idx)

    monkeypatch.setattr(DraftModule, "training_step", one_second_step)
    return clock


def last_lrs(out) -> list[float]:
    rows = [r for f in sorted(out.glob("csv/version_*/metrics.csv")) for r in csv.DictReader(open(f))]
    column = sorted(k for r in rows for k in r if k.startswith("lr-") and r[k])[0]  # the first param group
    return [float(r[column]) for r in rows if r.get(column)]


def test_budget_stops_at_the_steps_that_fit_with_the_schedule_sized_to_them(fast_cfg, tmp_path, step_clock):
    # 1 min, 0.75 of it reserved for the final α: 15 s of training, 15 one-second steps; 40 configured
    out = tmp_path / "run"
    record = run(fast_cfg("head=eagle3", "logger=csv", "trainer.max_steps=40", "trainer.val_check_interval=10",
                          "budget.minutes=1", "budget.reserve_minutes=0.75", "budget.first_plan_step=5",
                          "optim.lr=1e-3", "optim.min_lr_ratio=0.1", out=out))
    assert record["train_steps"] == 15, record["budget"]
    plans = record["budget"]["plans"]
    assert plans[0] == {"step": 5, "seconds_per_step": 1.0, "max_steps": 15}, plans
    assert all(p["max_steps"] == 15 for p in plans), plans  # the check at step 10 cost no clock time: same plan
    assert record["budget"]["fit_ended_minute"] == pytest.approx(15 / 60, abs=0.01)
    lrs = last_lrs(out)
    # sized to 15 steps, the cosine has reached its floor; sized to the configured 40 it would still be ~0.8 * lr
    assert lrs[-1] < 0.2e-3 and max(lrs) == pytest.approx(1e-3, rel=0.05), lrs


def test_a_later_plan_gives_back_steps_a_slow_start_took(fast_cfg, tmp_path, step_clock):
    # 30 s of training; the first 5 steps take 3 s, the rest 1 s. The first plan (step 4: 3 s per step) fits 10
    # steps; the checks every 4 steps see the steps speed up and plan more, while still ending inside the 30 s.
    step_clock.slow_steps, step_clock.slow_seconds = 5, 3.0
    record = run(fast_cfg("head=eagle3", "trainer.max_steps=40", "trainer.val_check_interval=4", "budget.minutes=1",
                          "budget.reserve_minutes=0.5", "budget.first_plan_step=4", out=tmp_path / "run"))
    plans = record["budget"]["plans"]
    assert plans[0] == {"step": 4, "seconds_per_step": 3.0, "max_steps": 10}, plans
    assert [p["max_steps"] for p in plans] == sorted(p["max_steps"] for p in plans), plans  # rising
    assert record["train_steps"] == plans[-1]["max_steps"] > 14, plans
    assert record["budget"]["fit_ended_minute"] <= 0.5


def test_a_ceiling_reached_early_reports_the_unused_window(fast_cfg, tmp_path, step_clock, caplog):
    # 30 s to train, 10 configured one-second steps: the ceiling ends training with 20 s (a third) of it unused
    with caplog.at_level("INFO", logger="train"):
        record = run(fast_cfg("head=eagle3", "trainer.max_steps=10", "trainer.val_check_interval=5",
                              "budget.minutes=1", "budget.reserve_minutes=0.5", "budget.first_plan_step=4",
                              out=tmp_path / "run"))
    assert record["train_steps"] == 10
    assert record["budget"]["unused_minutes"] == pytest.approx(20 / 60, abs=0.01)
    assert any("reached trainer.max_steps=10 with 0.3 of 1 min unused; more training data" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records if "budget" in r.getMessage()]


def test_no_budget_trains_the_configured_steps(fast_cfg, tmp_path, step_clock):
    record = run(fast_cfg("head=medusa", "trainer.max_steps=12", out=tmp_path / "run"))
    assert record["train_steps"] == 12 and "budget" not in record


def test_a_budget_with_no_time_to_train_is_refused(fast_cfg, tmp_path):
    with pytest.raises(UserError, match="budget.minutes=5 leaves no time to train"):
        run(fast_cfg("budget.minutes=5", "budget.reserve_minutes=5", out=tmp_path / "run"))


@pytest.mark.parametrize("step, per_step, left, ceiling, last", [
    (30, 2.0, 100.0, 1000, 80),   # 50 more fit
    (30, 2.0, 100.0, 60, 60),     # the configured steps are the ceiling
    (30, 2.0, -5.0, 1000, 31),    # already over: one more step, never fewer than taken
    (60, 2.0, 100.0, 60, 60),     # a check at the ceiling's step: done, not one step past it
])
def test_steps_that_fit(step, per_step, left, ceiling, last):
    assert steps_that_fit(step, per_step, left, ceiling) == last


def test_resume_keeps_the_budgets_schedule(fast_cfg, tmp_path, step_clock, monkeypatch):
    """A crash at step 13 (checkpoint at 12), then resume=true: the run still ends at the plan's step 15, annealed,
    though the resumed job's own new budget would fit more steps."""
    out = tmp_path / "run"
    args = ("head=eagle3", "logger=csv", "trainer.max_steps=40", "trainer.val_check_interval=10",
            "trainer.checkpoint_every_n_steps=4", "budget.minutes=1", "budget.reserve_minutes=0.75",
            "budget.first_plan_step=5", "optim.lr=1e-3")
    stepping = DraftModule.training_step

    def crash_at_13(self, batch, batch_idx):
        if self.global_step == 12:
            raise RuntimeError("killed")
        return stepping(self, batch, batch_idx)

    monkeypatch.setattr(DraftModule, "training_step", crash_at_13)
    with pytest.raises(RuntimeError, match="killed"):
        run(fast_cfg(*args, out=out))
    monkeypatch.setattr(DraftModule, "training_step", stepping)
    record = run(fast_cfg(*args, "resume=true", out=out))
    assert record["train_steps"] == 15, record["budget"]
    assert last_lrs(out)[-1] < 0.2e-3
