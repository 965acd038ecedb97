"""Turn logits into the distribution a sampler draws from: temperature, then top-k, then top-p.

Training's α and serve/'s verification both call ``probs_from_logits`` so that p and q always go through the
same processing (speculative sampling is exact only for the processed distributions).
"""
from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """[..., V] logits -> [..., V] float32 probabilities. temperature 0 gives a one-hot argmax."""
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)
