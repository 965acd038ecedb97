"""``trainer.precision=bf16-if-faster``: time a few training steps in fp32 and in bf16-mixed, train in the faster.

Whether bf16 pays on a CPU is not a flag question. With AMX, bf16-mixed trained the EAGLE-3 recipe 1.29x faster than
fp32, and on an AVX512-BF16 EPYC 1.19x; but on an AVX512-BF16 Xeon without AMX it trained at 0.68x fp32's speed
(243 against 357 trained tokens/s over the same first 60 batches; docs/results/training-and-scaling.md), so
``bf16-if-native`` cost that machine a third of its steps. The probe runs the module's own step (features, head,
loss, backward; no optimizer step, so the weights do not move) on the first training batches, alternating the two
precisions so that drift on a noisy machine falls on both, and takes bf16 only where it ran the same batches at
least ``MARGIN`` faster (fp32 is exact; a tie keeps it).
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

MARGIN = 0.05  # bf16 must save this fraction of a step to be chosen
CHOICES = {"32-true": None, "bf16-mixed": torch.bfloat16}


def time_step(module, batch: dict, dtype: torch.dtype | None) -> float:
    """Seconds for one forward and backward of ``module.step_loss`` under CPU autocast to ``dtype`` (None: fp32),
    as Lightning's bf16-mixed runs it: the forward autocast, the backward outside."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss, _ = module.step_loss(batch, with_alpha=False)  # as most training steps run (train/module.py)
    loss.backward()
    seconds = time.perf_counter() - t0
    module.head.zero_grad(set_to_none=True)
    return seconds


def fastest_precision(module, batches: list[dict], repeats: int = 2, keep_memory: bool = True) -> dict:
    """{"precision": the faster of 32-true and bf16-mixed, "seconds_per_step": {precision: mean}} over ``batches``
    (the first pass over the first batch warms both up and is not counted), each timed ``repeats`` times per
    precision; ``keep_memory``: under ``keep_freed_memory``, as training runs its steps with it (conf)."""
    from train.trainer import keep_freed_memory

    timed = {name: [] for name in CHOICES}
    if keep_memory:
        keep_freed_memory()
    module.train()
    try:
        with torch.random.fork_rng(devices=[]):  # the probe draws nothing training would see
            for i, batch in enumerate(batches * repeats):
                for name, dtype in (CHOICES.items() if i % 2 else reversed(CHOICES.items())):
                    seconds = time_step(module, batch, dtype)
                    if i > 0:
                        timed[name].append(seconds)
    finally:
        if keep_memory:
            keep_freed_memory(keep=False)
    per_step = {name: round(sum(s) / len(s), 4) for name, s in timed.items()}  # the same batches in both
    bf16_wins = per_step["bf16-mixed"] < (1 - MARGIN) * per_step["32-true"]
    choice = "bf16-mixed" if bf16_wins else "32-true"
    log.info("precision: a step took %.2f s in fp32 and %.2f s in bf16-mixed (%d batches); training in %s",
             per_step["32-true"], per_step["bf16-mixed"], len(batches), choice)
    return {"precision": choice, "seconds_per_step": per_step, "batches": len(batches), "repeats": repeats}
