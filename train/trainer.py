"""The Lightning Trainer a job runs with: accelerator and precision from the machine (``resolve_hardware``), the
strategy (Lightning's, or train/strategies.py's CPU DeepSpeed), the logger and the checkpoint callback.

Lightning loads inside the functions, so that train/main.py's ``--cfg job`` and ``--help`` answer in a second or two.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from heads.target import resolve_dtype
from train import UserError

log = logging.getLogger("train")


def resolve_strategy(name, options: dict | None):
    """A Lightning strategy name passes through; others (CPU DeepSpeed) come from train/strategies.py."""
    from lightning.pytorch.strategies import StrategyRegistry

    options = options or {}
    if not isinstance(name, str) or (name in ("auto", "ddp", "ddp_spawn", "fsdp", "deepspeed") and not options):
        return name
    if name in StrategyRegistry:
        entry = StrategyRegistry[name]
        return entry["strategy"](**{**entry["init_params"], **options}) if options else name
    from train import strategies  # lazy: DeepSpeed is optional and heavy to import

    return strategies.build_strategy(name, **options)


def build_logger(cfg: DictConfig):
    lcfg = cfg.get("logger")
    if not lcfg or not lcfg.get("_target_"):
        return False
    return hydra.utils.instantiate(lcfg)


def build_trainer(cfg: DictConfig, out: Path, extra_callbacks=()):
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    strategy = resolve_strategy(kwargs.pop("strategy", "auto"), kwargs.pop("strategy_options", None))
    every = kwargs.pop("checkpoint_every_n_steps", None)
    logger = build_logger(cfg)
    callbacks = [ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0,
                                 every_n_train_steps=every or None), *extra_callbacks]
    if logger:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if cfg.get("keep_freed_memory") and glibc() is not None:
        callbacks.append(trim_freed_memory())
    return L.Trainer(strategy=strategy, logger=logger, callbacks=callbacks, default_root_dir=str(out),
                     use_distributed_sampler=False,  # the DataModule shards its own resumable batches
                     **kwargs)


def resolve_hardware(cfg: DictConfig) -> tuple[str, str]:
    """Fill in ``trainer.accelerator/precision: auto`` from the machine; returns (this rank's device, target dtype).

    No trainer override: every visible GPU in bf16-mixed (fp16-mixed where the GPU has no bf16) when CUDA is
    present, fp32 on the CPU otherwise; ``precision: bf16-if-native`` picks bf16-mixed on a CPU with AMX or
    AVX512-BF16 as well, and ``bf16-if-faster`` stays unresolved there, for ``fit`` to time both
    (train/precision.py). The target is then loaded straight onto this rank's GPU (LOCAL_RANK, set
    by Lightning's launcher or torchrun) in its dtype: no rank ever holds a full copy of a 7B target in host RAM.
    """
    t = cfg.trainer
    cuda = torch.cuda.is_available()
    if t.accelerator == "auto":
        t.accelerator = "gpu" if cuda else "cpu"
    if t.accelerator in ("gpu", "cuda") and not cuda:
        raise UserError(f"trainer.accelerator={t.accelerator} but torch sees no CUDA device; drop the GPU trainer "
                        "override, or add trainer.accelerator=cpu trainer.precision=32-true")
    on_gpu = t.accelerator in ("gpu", "cuda")
    if t.precision == "bf16-if-faster" and not on_gpu and cpu_has_bf16_units() and single_process(t):
        pass  # train/main.py fit times both once the data is ready (train/precision.py)
    elif t.precision in PRECISION_CHOICES:
        if on_gpu:
            t.precision = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
        else:  # bf16 only with bf16 units (emulated, its matmuls ran 8x slower than fp32:
            # docs/results/training-and-scaling.md); bf16-if-faster in several processes: as bf16-if-native, since
            # each rank would time its own steps and might choose differently
            t.precision = "bf16-mixed" if t.precision != "auto" and cpu_has_bf16_units() else "32-true"
    if str(t.precision).startswith("16") and not on_gpu:
        raise UserError(f"trainer.precision={t.precision} needs a CUDA device; use 32-true or bf16-mixed on CPU")
    if str(t.precision).startswith("bf16") and on_gpu and not torch.cuda.is_bf16_supported():
        raise UserError(f"{torch.cuda.get_device_name()} has no bfloat16; pass trainer.precision=16-mixed "
                        "target.dtype=float16")
    if str(t.precision).startswith("bf16") and not on_gpu and not cpu_has_bf16_units():
        log.warning("trainer.precision=%s on a CPU without AMX or AVX512-BF16: its bf16 matmuls are emulated and "
                    "slower than trainer.precision=32-true", t.precision)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if on_gpu else "cpu"
    return device, resolve_dtype(cfg.target.dtype, device)


PRECISION_CHOICES = ("auto", "bf16-if-native", "bf16-if-faster")  # resolved here (and in train/precision.py)


def single_process(t: DictConfig) -> bool:
    """One training process: no several devices, nodes or a multi-process strategy asked for."""
    return str(t.devices) in ("auto", "1") and int(t.get("num_nodes", 1)) == 1 and \
        not any(s in str(t.get("strategy")) for s in ("ddp", "deepspeed", "fsdp"))


def cpu_has_bf16_units() -> bool:
    """AMX or AVX512-BF16: where bf16-mixed trains a head faster than fp32 on the CPU (1.3x measured,
    docs/results/training-and-scaling.md)."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def glibc():
    """The C library when it is glibc (mallopt, malloc_trim), else None (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory(keep: bool = True) -> bool:
    """Have glibc serve large blocks from its heap and keep them there when freed (mallopt), so the next training
    step reuses memory that is already mapped; ``keep=False`` puts back the thresholds glibc's own adjustment grows to
    (32 MiB mmap, 64 MiB trim) and trims. By default every block over the mmap threshold is a fresh mmap, unmapped on
    free, and the kernel faults it in again 4 KiB at a time every step: 20-41% of the recipes' CPU time
    (docs/results/training-and-scaling.md). Only blocks allocated after the call are affected. Kept memory alone
    grows (batches of varying length free blocks later sizes do not fit: a Medusa recipe run was killed at 24 GiB),
    so only training keeps it, trimmed every few steps: ``trim_freed_memory``. Returns False where the C library is
    not glibc (macOS, musl): nothing to do there."""
    libc = glibc()
    if libc is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mmap, trim = (2**31 - 1, 2**31 - 1) if keep else (32 << 20, 64 << 20)  # mallopt takes a C int: 2 GiB at most
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, mmap)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim))
    if not keep:
        libc.malloc_trim(0)
    return done


def trim_freed_memory(every: int = 25):
    """The callback for ``keep_freed_memory: true``: memory is kept from the start of fit to its end only (not while
    answering prompts, building the feature cache or measuring the final α, which run unbounded by it), and the
    heap's free pages go back to the kernel (malloc_trim) every ``every`` training steps and after each held-out
    check, so what one stretch of steps leaves free cannot pile up into the next. The steps in between keep the speed
    of kept memory; one step in ``every`` faults its blocks in again."""
    from lightning.pytorch.callbacks import Callback

    libc = glibc()

    class TrimFreedMemory(Callback):
        def on_fit_start(self, trainer, *args) -> None:
            keep_freed_memory()

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step % every == 0:
                libc.malloc_trim(0)

        def on_validation_end(self, trainer, *args) -> None:
            libc.malloc_trim(0)

        def on_fit_end(self, trainer, *args) -> None:
            keep_freed_memory(keep=False)

    return TrimFreedMemory()
