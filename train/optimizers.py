"""The head's optimizer: AdamW, or Muon on the hidden weight matrices with AdamW on the rest (optim.name=muon).

Muon (Jordan et al. 2024; torch.optim.Muon) orthogonalises each 2-D update, which speculators trains its heads with
by default. It only takes matrices, and the output projection and embeddings do better with AdamW (Muon's authors'
advice, speculators' split), so the head's parameters are split in two and stepped as one optimizer.

torch's Muon orthogonalises in bf16. Where training runs in fp32 that is the slower choice: the CPU either lacks fast
bf16 products (the precision probe chose fp32, train/precision.py) or emulates them. On a 2-core AVX512-BF16 Xeon
without AMX the EAGLE-3 head's eight matrices took 0.47 s a step in bf16 and 0.30 s in fp32, a fifth of the step
(docs/results/training-and-scaling.md). So the Newton-Schulz iteration runs in the training's own dtype.
"""
from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw", "muon")


def newton_schulz(update: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalisation of a matrix, computed in ``dtype``."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller square
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz iteration in ``ns_dtype``; bf16 is torch's own step, unchanged."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # torch's single-tensor step, but for the dtype
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss


def lr_ratio(adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's per-matrix learning-rate scale."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


class MuonAdamW(torch.optim.Optimizer):
    """Muon on ``matrices``, AdamW on ``others``, as one optimizer: Lightning's automatic optimisation, gradient
    clipping, the LR scheduler and checkpoints see one object. ``param_groups`` are the inner optimizers' own
    dicts, so the scheduler's learning rate reaches both."""

    def __init__(self, matrices, others, lr: float, betas, weight_decay: float, muon_weight_decay: float = 0.1,
                 ns_dtype: torch.dtype = torch.bfloat16):
        self.muon = Muon(matrices, ns_dtype=ns_dtype, lr=lr, weight_decay=muon_weight_decay,
                         adjust_lr_fn="match_rms_adamw")  # AdamW's update size: the same lr works
        self.adamw = torch.optim.AdamW(decay_groups(others, weight_decay), lr=lr, betas=tuple(betas))
        super().__init__([*matrices, *others], {"lr": lr})  # the base class's bookkeeping (hooks, zero_grad)
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):  # the inner optimizers own the state; a merged view for whoever reads it (device moves)
        return {**self.muon.state, **self.adamw.state}

    @state.setter
    def state(self, value):  # Optimizer.__init__ assigns an empty one
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict):
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def decay_groups(params, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: none on norms and biases."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_optimizer(name: str, named_params, lr: float, betas, weight_decay: float,
                    ns_dtype: torch.dtype = torch.bfloat16) -> torch.optim.Optimizer:
    """AdamW with no decay on norms and biases, or MuonAdamW: Muon on the hidden matrices (not lm_head, not
    embeddings), orthogonalised in ``ns_dtype``, AdamW on everything else."""
    params = [(n, p) for n, p in named_params if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(decay_groups([p for _, p in params], weight_decay), lr=lr, betas=tuple(betas))
    if name == "muon":
        hidden = lambda n, p: p.ndim == 2 and "lm_head" not in n and "embed" not in n
        matrices = [p for n, p in params if hidden(n, p)]
        others = [p for n, p in params if not hidden(n, p)]
        return MuonAdamW(matrices, others, lr, betas, weight_decay, ns_dtype=ns_dtype)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
