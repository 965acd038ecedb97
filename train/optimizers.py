"""The head's optimizer: AdamW, or Muon on the hidden weight matrices with AdamW on the rest (optim.name=muon).

Muon (Jordan et al. 2024; torch.optim.Muon) orthogonalises each 2-D update, which speculators trains its heads with
by default. It only takes matrices, and the output projection and embeddings do better with AdamW (Muon's authors'
advice, speculators' split), so the head's parameters are split in two and stepped as one optimizer.
"""
from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "muon")


class MuonAdamW(torch.optim.Optimizer):
    """Muon on ``matrices``, AdamW on ``others``, as one optimizer: Lightning's automatic optimisation, gradient
    clipping, the LR scheduler and checkpoints see one object. ``param_groups`` are the inner optimizers' own
    dicts, so the scheduler's learning rate reaches both."""

    def __init__(self, matrices, others, lr: float, betas, weight_decay: float, muon_weight_decay: float = 0.1):
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=muon_weight_decay,
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


def build_optimizer(name: str, named_params, lr: float, betas, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with no decay on norms and biases, or MuonAdamW: Muon on the hidden matrices (not lm_head, not
    embeddings), AdamW on everything else."""
    params = [(n, p) for n, p in named_params if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(decay_groups([p for _, p in params], weight_decay), lr=lr, betas=tuple(betas))
    if name == "muon":
        hidden = lambda n, p: p.ndim == 2 and "lm_head" not in n and "embed" not in n
        matrices = [p for n, p in params if hidden(n, p)]
        others = [p for n, p in params if not hidden(n, p)]
        return MuonAdamW(matrices, others, lr, betas, weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
