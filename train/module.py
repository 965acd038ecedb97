"""The LightningModule: frozen target -> features -> head -> distillation loss, plus α on held-out batches.

``training_step`` is the one-way flow of heads/: ``feats = target.features(batch)`` (no grad, eval),
``out = head(feats)``, ``loss, stats = head_loss(head, out, feats)``, then logging. The target is a plain attribute,
not a registered submodule, so its parameters never reach the optimizer, DDP's gradient buckets, DeepSpeed's
partitions or the checkpoint; only the head is trained and saved.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch

from heads.base import DraftHead, TargetFeatures, linear_rows
from heads.losses import LOSS_KINDS, head_loss
from heads.target import Target
from train import UserError
from train.acceptance import Tally, acceptance_grid
from train.optimizers import OPTIMIZERS, build_optimizer


@dataclass
class LossConfig:
    kind: str = "soft_ce"  # soft_ce | kl | tv | lk | lk_alpha: heads/losses.py distill_loss
    step_decay: float = 1.0  # weight of draft step k is step_decay**(k-1); EAGLE-3 uses 0.8

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise UserError(f"head.loss.kind={self.kind} is not a loss; choose one of {', '.join(LOSS_KINDS)}")


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon on the hidden matrices, AdamW on the rest: train/optimizers.py)
    lr: float = 3e-4
    weight_decay: float = 0.0  # heads are small and trained briefly; decay mostly slows them down
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20  # linear warm-up, then cosine to min_lr_ratio * lr over the remaining steps
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise UserError(f"optim.name={self.name} is not an optimizer; choose one of {', '.join(OPTIMIZERS)}")


@dataclass
class EvalConfig:
    temperature: float = 0.0  # 0: greedy α, i.e. 1[argmax draft == argmax target]
    top_k: int = 0
    top_p: float = 1.0
    extra_temperatures: tuple[float, ...] = (1.0,)  # also reported in acceptance.json (same forward, cheap)
    best_by: str = "tau"  # the kept head: highest held-out τ at γ = K (the chain walk) | "alpha" (α@1)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class DraftModule(L.LightningModule):
    def __init__(self, head: DraftHead, target: Target, loss: LossConfig, optim: OptimConfig, evaluation: EvalConfig):
        super().__init__()
        self.head = head
        self.target = target  # a dataclass, not an nn.Module: stays out of state_dict and parameters()
        self.loss_cfg, self.optim_cfg, self.eval_cfg = loss, optim, evaluation
        self._val_tally: Tally | None = None
        self.heldout: dict | None = None  # the last mid-run check: step, trained tokens, α per step, τ per γ
        self.trained_tokens = 0  # tokens the loss was computed on (this process, this run), for trained tokens/s
        self.tokens_total = 0  # every rank's trained tokens since step 0, resumes included (checkpointed)
        self.train_seconds = 0.0
        self._step_start: float | None = None
        self.schedule_total: int | None = None  # the LR schedule's steps; train/budget.py may shorten it mid-run

    def _move_target(self) -> None:
        self.target.model.to(self.device)

    def on_fit_start(self) -> None:
        self._move_target()

    def on_validation_start(self) -> None:
        self._move_target()

    def features(self, batch: dict[str, torch.Tensor], columns: torch.Tensor | None = None) -> TargetFeatures:
        """The target's features of ``batch``, its logits only for the target ids ``columns`` where given."""
        attn = batch["attention_mask"]
        L = self.target.dims.num_layers
        if f"hidden.{L}" in batch:  # features cached by the DataModule: only the lm_head runs here
            dtype = self.target.lm_head.weight.dtype  # disk-cached features are bf16 whatever the target's dtype
            hidden = {int(k.split(".")[1]): v.to(dtype) for k, v in batch.items() if k.startswith("hidden.")}
            mask = batch["loss_mask"]
            with torch.no_grad():  # logits only where a loss or α reads them (prompts are often half the tokens),
                # packed [N, V]: a dense [B, T, 49k] fp32 buffer was 800 MB to zero, scatter into and gather back
                logits = linear_rows(self.target.lm_head, hidden[L][mask], columns).float()
            return TargetFeatures(batch["input_ids"], hidden, logits, mask, attn, columns)
        attn = None if bool(attn.all()) else attn  # no padding: let attention take its fast causal path
        return self.target.features(batch["input_ids"], batch["loss_mask"], attn, layers=self.head.feature_layers,
                                    columns=columns)

    def loss_columns(self) -> torch.Tensor | None:
        """The target ids the loss reads this step (a reduced draft or loss vocabulary), None where it reads all."""
        V = self.target.dims.vocab_size
        cols = self.head.draft_token_ids(self.target.lm_head.weight.device)
        return None if cols.numel() == V else cols

    def head_dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self._step_start is None:
            return
        self.train_seconds += time.perf_counter() - self._step_start  # steps only: validation is not training
        self.trained_tokens += int(batch["loss_mask"].sum())
        self.log("train/tokens_per_s", self.trained_tokens / max(self.train_seconds, 1e-9), prog_bar=True,
                 batch_size=batch["input_ids"].shape[0])

    def step_loss(self, batch, with_alpha: bool = True) -> tuple[torch.Tensor, dict]:
        """The training loss of one batch and its stats (train/precision.py times this under each precision).
        Without α the target's lm_head computes only the columns the loss reads (α needs the full vocabulary's
        argmax or normaliser): EAGLE-3's 8k of SmolLM2's 49k gave the recipe 1.10x the trained tokens/s."""
        if hasattr(self.head, "resample_loss_vocab"):  # EAGLE-1/MTP/Medusa: this step's sampled loss tokens
            self.head.resample_loss_vocab(self.global_step)
        columns = None if with_alpha else self.loss_columns()
        feats = self.features(batch, columns).hidden_as(self.head_dtype())  # a bf16/fp16 target feeds an fp32 head
        out = self.head(feats)
        return head_loss(self.head, out, feats, self.loss_cfg.kind, self.loss_cfg.step_decay,
                         temperature=self.eval_cfg.temperature)  # train/alpha@k comparable to val/alpha@k

    def training_step(self, batch, batch_idx):
        # train/alpha@k only on the steps whose metrics reach the logger (Lightning writes every log_every_n_steps)
        loss, stats = self.step_loss(batch, with_alpha=(self.global_step + 1) % self.trainer.log_every_n_steps == 0)
        B = batch["input_ids"].shape[0]
        tokens = batch["loss_mask"].sum()  # counted here, not in on_train_batch_end: checkpoints are written first
        if self.trainer.world_size > 1:  # every rank holds the global count, so rank 0's checkpoint has it
            tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
        self.tokens_total += int(tokens)
        self.log("train/loss", loss, prog_bar=True, batch_size=B)
        for name, value in stats.items():
            if not name.startswith("count@"):
                self.log(f"train/{name}", value.float(), prog_bar=name == "alpha@1", batch_size=B)
        return loss

    def validation_step(self, batch, batch_idx):
        """acceptance.measure's α and chain walk, on the DataModule's cached held-out features when it has them."""
        feats = self.features(batch).hidden_as(self.head_dtype())
        e = self.eval_cfg
        grid = acceptance_grid(self.head, self.head(feats), feats, e.temperature, e.top_k, e.top_p)  # [B, T, K]
        if self._val_tally is None:
            self._val_tally = Tally(grid.shape[-1])
        self._val_tally.add(grid, batch["loss_mask"])

    def on_validation_epoch_end(self) -> None:
        if self._val_tally is None:
            return
        flat = self.trainer.strategy.reduce(self._val_tally.to_tensor().to(self.device), reduce_op="sum")
        self._val_tally = None  # exact over every rank's share, divided once
        summary = Tally.from_tensor(flat).summary()
        taus = {str(g): t for g, t in summary["tau_predicted"].items()}  # str keys: the same after a JSON round trip
        self.heldout = {"step": self.trainer.global_step, "trained_tokens": self.tokens_total,
                        "alpha": summary["alpha"], "tau_predicted": taus, "num_tokens": summary["num_tokens"][0]}
        for k, a in enumerate(summary["alpha"], start=1):
            self.log(f"val/alpha@{k}", a, rank_zero_only=True)
        for gamma, tau in summary["tau_predicted"].items():
            self.log(f"val/tau@{gamma}", tau, rank_zero_only=True)
        # float64: a float32 count is off by hundreds beyond 2^24 tokens
        self.log("val/trained_tokens", torch.tensor(float(self.tokens_total), dtype=torch.float64, device=self.device),
                 rank_zero_only=True)

    def newton_schulz_dtype(self) -> torch.dtype:
        """Muon orthogonalises in the training's dtype: fp32 where training runs in fp32 (train/optimizers.py)."""
        return torch.float32 if str(self.trainer.precision).startswith(("32", "64")) else torch.bfloat16

    def configure_optimizers(self):
        o = self.optim_cfg
        opt = build_optimizer(o.name, self.head.named_parameters(), o.lr, o.betas, o.weight_decay,
                              ns_dtype=self.newton_schulz_dtype())
        self.schedule_total = int(self.trainer.estimated_stepping_batches)
        warmup = min(o.warmup_steps, max(1, self.schedule_total // 10))
        sched = torch.optim.lr_scheduler.LambdaLR(  # reads schedule_total at every step: a budget may shorten it
            opt, lambda s: lr_lambda(s, warmup, self.schedule_total, o.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # RNG state travels with the checkpoint (Lightning keeps only model, optimizer, scheduler, loops, data state),
    # stored as plain tensors/lists so the checkpoint loads with weights_only=True.
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        np_state = np.random.get_state()
        checkpoint["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
        checkpoint["trained_tokens_total"] = self.tokens_total
        if torch.cuda.is_available():
            checkpoint["rng"]["cuda"] = torch.cuda.get_rng_state_all()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_total = int(checkpoint.get("trained_tokens_total", 0))
        rng = checkpoint.get("rng")
        if not rng:
            return
        torch.set_rng_state(rng["torch"])
        py = rng["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np_state = rng["numpy"]
        np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
