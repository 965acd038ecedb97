"""Medusa-1 (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads").

K independent heads read the target's final-norm hidden state h_t. Head k (0-based) is ``num_layers`` residual
blocks x + SiLU(Wx + b), W zero-initialised so an untrained head starts as the target's own lm_head, then its own
lm_head initialised from the target's. Head k at position t predicts x_{t+k+2}, i.e. draft step k+1 in the
convention of heads.base. Not autoregressive: every step reads the same h_t, so ``step`` ignores the drafted token.
Training may score a reduced vocabulary (``loss_vocab_size`` + ``loss_vocab_sampled``; heads.base.FrequentTokenLoss):
each step then computes and trains only those rows of the lm_heads.
Parameter names are vLLM's Medusa names (``blocks.{k}.layers.{l}``, ``lm_heads.{k}``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead, FrequentTokenLoss, HeadOutput, TargetDims, TargetFeatures


class ResBlock(nn.Module):
    def __init__(self, hidden: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))
        for layer in self.layers:  # identity at start: the head begins exactly as the target's lm_head
            nn.init.zeros_(layer.weight)
            if bias:
                nn.init.zeros_(layer.bias)

    def forward(self, x):
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class Medusa(FrequentTokenLoss, DraftHead):
    family = "medusa"

    def __init__(self, dims: TargetDims, num_steps: int = 5, num_layers: int = 1, bias: bool = True,
                 loss_vocab_size: int | None = None, loss_vocab_sampled: int = 0):
        super().__init__(dims, num_steps)
        self.num_layers, self.bias = num_layers, bias
        self.init_loss_vocab(loss_vocab_size, loss_vocab_sampled)  # training-only: heads.base.FrequentTokenLoss
        self.blocks = nn.ModuleList(ResBlock(dims.hidden_size, num_layers, bias) for _ in range(num_steps))
        self.lm_heads = nn.ModuleList(nn.Linear(dims.hidden_size, dims.vocab_size, bias=False) for _ in range(num_steps))

    def hparams(self) -> dict:
        return {"num_steps": self.num_steps, "num_layers": self.num_layers, "bias": self.bias,
                **self.loss_vocab_hparams()}

    @torch.no_grad()
    def init_from_target(self) -> None:
        """Copy the target's lm_head into every head's lm_head (Medusa's initialisation)."""
        for head in self.lm_heads:
            head.weight.copy_(self.frozen("lm_head").weight)

    @property
    def max_draft_steps(self) -> int:
        return self.num_steps

    def head_logits(self, h: torch.Tensor, k: int) -> torch.Tensor:
        return self.vocab_linear(self.lm_heads[k], self.blocks[k](h))

    def forward(self, feats: TargetFeatures, num_steps: int | None = None) -> HeadOutput:
        h = feats.hidden[self.dims.num_layers]  # [B, T, H]
        # Every head reads the same h_t; its ResBlock and lm_head run only where the loss reads them.
        return HeadOutput([h] * (num_steps or self.num_steps), readout=lambda k, rows: self.head_logits(rows, k - 1))

    # Drafting: the "cache" is just the last committed hidden state.
    def new_cache(self, max_len, device, dtype):
        return {}

    def commit(self, cache, hidden, next_tokens, start):
        h = hidden[self.dims.num_layers][:, -1]  # [1, H]
        return self.head_logits(h, 0), h

    def step(self, cache, state, token, depth):
        return self.head_logits(state, depth - 1), state
