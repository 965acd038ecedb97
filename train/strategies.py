"""Distributed strategies from config, a DeepSpeed strategy that also runs on CPU, and full fp32 head weights.

``trainer.strategy: deepspeed_zero`` (conf/trainer/deepspeed_zero{1,2,3}.yaml) builds ``DeepSpeedStrategy`` below:
Lightning's own on CUDA, and over gloo on CPU, so ``trainer=deepspeed_zero2 trainer.accelerator=cpu`` tests here
the same configs that run on GPUs. Lightning's registry names (``ddp``, ...) never reach this file.

``consolidated_head(trainer, head)`` returns a plain full-precision copy of the head: under ZeRO-3 every rank holds
only a shard of each weight, and under DeepSpeed bf16 the module holds bf16 copies while the fp32 master weights live
in the optimizer's partitions. Saving ``head.state_dict()`` would write empty shards or rounded weights; the copy is
what the native checkpoint and the final acceptance measurement use, whatever the strategy.
"""
from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeed

from heads import build_head
from heads.base import DraftHead
from train import UserError


class DeepSpeedStrategy(_LightningDeepSpeed):
    """Lightning's DeepSpeedStrategy, minus the checks that pin it to CUDA.

    On CPU (Lightning 2.6.6 + DeepSpeed 0.19.8) three things differ: ``setup_environment`` refuses any accelerator
    but CUDA; ``setup_distributed`` checks CPU device indices (all None) against local ranks; and
    ``deepspeed.initialize`` gets ``device_rank=root_device.index`` (None on CPU, which it compares with 0). On CUDA
    every method defers to Lightning unchanged.
    """

    strategy_name = "draftheads_deepspeed"

    def _on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    def setup_environment(self) -> None:
        if not self._on_cpu():
            return super().setup_environment()
        DDPStrategy.setup_environment(self)  # device setup + setup_distributed (below), without the CUDA check

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or "gloo"
        # DeepSpeed JIT-compiles a shared-memory all-reduce on first CPU use (1-4 min, needs a C++ toolchain). Only
        # its inference all-reduce uses it; ZeRO training communicates through torch.distributed (gloo) either way.
        # deepspeed.ops caches the probed table in the module, so marking the op incompatible skips the build.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self._init_deepspeed_distributed()

    # DeepSpeed's bf16/fp16 mode casts the head and the batch's float tensors (cached target features) to half
    # precision but, unlike Lightning's DDP mixed precision, runs no autocast: the frozen target, which DeepSpeed never
    # sees, would meet half-precision activations in its fp32 lm_head or norm. Autocast around each step lets fp32
    # and half tensors meet, as under DDP; the fp32 master weights stay in DeepSpeed's optimizer.
    def _autocast(self):
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision_plugin.precision)
        return torch.autocast(self.root_device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def training_step(self, *args, **kwargs):
        with self._autocast():
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args, **kwargs):
        with self._autocast():
            return super().validation_step(*args, **kwargs)

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        if not self._on_cpu():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
            lr_scheduler=lr_scheduler, dist_init_required=False,
        )
        return engine, ds_optimizer


def build_strategy(name: str, **options) -> Strategy:
    """A strategy Lightning's registry lacks, from ``trainer.strategy`` + ``trainer.strategy_options``.

    train/main.py resolves Lightning's own names (``auto``, ``ddp``, ...) itself and calls this for the rest.
    ``deepspeed_zero``: DeepSpeed ZeRO (``strategy_options.stage`` 1|2|3, plus any DeepSpeedStrategy keyword) on
    CUDA or CPU.
    """
    if name == "deepspeed_zero":
        return DeepSpeedStrategy(**options)
    raise UserError(f"unknown trainer.strategy {name!r}; choose deepspeed_zero or a Lightning strategy name "
                    "(auto, ddp, deepspeed_stage_2, ...)")


def full_state_dict(strategy: Strategy, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of ``module`` whole and in fp32 on CPU, on every rank. Collective: call it on all ranks."""
    if not isinstance(strategy, _LightningDeepSpeed):
        return {k: _cpu(v) for k, v in module.state_dict().items()}
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    params = dict(module.named_parameters())
    sharded = [p for p in params.values() if hasattr(p, "ds_id")]  # ZeRO-3 partitions
    out = {}
    # GatheredParameters makes ZeRO-3 shards whole for the frozen or buffer-like entries; trainable weights come
    # from the optimizer's fp32 master copy (safe_get_full_fp32_param all-gathers it under any ZeRO stage).
    with deepspeed.zero.GatheredParameters(sharded, modifier_rank=None, enabled=bool(sharded)):
        for name, value in module.state_dict().items():
            p = params.get(name)
            master = safe_get_full_fp32_param(p) if p is not None and p.requires_grad else None
            out[name] = _cpu(master if master is not None else value)
    return out


def consolidated_head(trainer, head: DraftHead) -> DraftHead:
    """A plain fp32 CPU copy of ``head`` with its full trained weights, attached to the same frozen target modules.

    Collective (all ranks must call it); every rank gets the copy, so rank 0 can save and measure it alone.
    """
    state = full_state_dict(trainer.strategy, head)
    plain = build_head(head.family, copy.deepcopy(head.dims), **head.hparams())
    plain.load_state_dict(state)
    plain.attach_modules(head.frozen("embed_tokens"), head.frozen("lm_head"), head.frozen("final_norm"))
    return plain.float().eval()


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return (t.float() if t.is_floating_point() else t).clone()
