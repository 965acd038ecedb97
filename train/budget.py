"""A wall-clock budget for the whole job: ``budget.minutes=120`` fits the training steps to the time left.

The stages before training (answering prompts, the feature cache) and the steps themselves run at very different
speeds on different CPUs: the EAGLE-3 recipe's 3,200 steps took 58.6 min on an AMX Xeon, while a Xeon without AMX
trained 0.40x its tokens/s in bf16 (docs/results/training-and-scaling.md). A fixed step count therefore misses a
time goal on the slower machine, and Lightning's own ``max_time`` would stop mid-schedule, before the learning rate
has decayed, which is where a head gains most. Instead, ``TimeBudget`` times the steps as they run (held-out checks
and checkpoint writes included) and lowers ``max_steps`` to the steps that fit before ``deadline - reserve``; the
cosine schedule is sized to the new total, so a shorter run still ends annealed. The configured
``trainer.max_steps`` stays the ceiling: the budget only shortens that, though a later plan may give back steps an
earlier, slower estimate took away.

The plan is made after a few steps and again after each held-out check, whose cost it then includes. It travels with
the checkpoint, so ``resume=true`` continues the same schedule (until a later plan fits it to the resumed job's own
deadline).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lightning.pytorch.callbacks import Callback

from train import UserError

log = logging.getLogger(__name__)


@dataclass
class BudgetConfig:
    minutes: float | None = None  # the whole job's wall clock, from the start of train/main.py's run; None: no budget
    reserve_minutes: float = 5.0  # kept for what follows training: the final α on the held-out text (the EAGLE-3
    # recipe's took 4 min on an AMX Xeon, docs/results/training-and-scaling.md)
    first_plan_step: int = 30  # steps timed before the first plan (past the first steps' warm-up of allocator/caches)

    def __post_init__(self):
        if self.minutes is not None and self.minutes <= self.reserve_minutes:
            raise UserError(f"budget.minutes={self.minutes} leaves no time to train after budget.reserve_minutes="
                             f"{self.reserve_minutes}; raise budget.minutes or lower budget.reserve_minutes")


def steps_that_fit(step: int, seconds_per_step: float, seconds_left: float, ceiling: int) -> int:
    """The last step the run can reach: ``step`` plus the steps that fit in ``seconds_left``, at least one more
    (a plan never ends a run before it has stepped), and never past ``ceiling`` (a check at the last configured
    step once planned one step beyond it)."""
    more = int(seconds_left // max(seconds_per_step, 1e-9))
    return min(ceiling, max(step + 1, step + more))


class TimeBudget(Callback):
    """Lower ``trainer.max_steps`` (and the module's ``schedule_total``) so that fit ends by ``deadline - reserve``
    (``time.monotonic()`` seconds)."""

    def __init__(self, cfg: BudgetConfig, deadline: float):
        self.cfg, self.fit_end = cfg, deadline - 60 * cfg.reserve_minutes
        self.planned: int | None = None  # the last plan's max_steps
        self.ceiling: int | None = None  # the configured trainer.max_steps: no plan goes past it
        self.plans: list[dict] = []  # every plan: step, seconds per step, max_steps (logged, kept in acceptance.json)
        self._t0 = self._step0 = None

    def on_train_start(self, trainer, module) -> None:
        self._t0, self._step0 = time.monotonic(), trainer.global_step
        self.ceiling = trainer.max_steps  # before any plan lowers it
        if self.planned is not None:  # resumed: the checkpoint's plan sizes the schedule from its first step
            self._apply(trainer, module, min(self.planned, trainer.max_steps))

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step - self._step0 == self.cfg.first_plan_step:
            self._plan(trainer, module)

    def on_validation_end(self, trainer, module) -> None:
        if not trainer.sanity_checking and trainer.global_step - self._step0 > self.cfg.first_plan_step:
            self._plan(trainer, module)

    def _plan(self, trainer, module) -> None:
        now, step = time.monotonic(), trainer.global_step
        per_step = (now - self._t0) / (step - self._step0)  # wall per step since fit started: checks included
        last = steps_that_fit(step, per_step, self.fit_end - now, self.ceiling)
        last = int(trainer.strategy.broadcast(last, src=0))  # every rank stops at rank 0's step
        self.plans.append({"step": step, "seconds_per_step": round(per_step, 4), "max_steps": last})
        # A plan may also rise again, back towards the ceiling: the first check's plan charges that check and the
        # first steps' warm-up to few steps, and locking it in left 9 of a 115-minute budget unused
        # (docs/results/training-and-scaling.md).
        # A later plan's lengthened cosine raises the LR only slightly, and less the later it comes.
        if last != trainer.max_steps:
            log.info("budget: %.2f s per step, %.0f min left for training: max_steps %d -> %d", per_step,
                     (self.fit_end - now) / 60, trainer.max_steps, last)
            self._apply(trainer, module, last)

    def _apply(self, trainer, module, last: int) -> None:
        trainer.fit_loop.epoch_loop.max_steps = last
        module.schedule_total = last  # the LR schedule's length (train/module.py configure_optimizers)
        self.planned = last

    def state_dict(self) -> dict:
        return {"planned": self.planned, "plans": self.plans}

    def load_state_dict(self, state_dict: dict) -> None:
        self.planned, self.plans = state_dict.get("planned"), list(state_dict.get("plans", []))
