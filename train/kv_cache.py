"""A KV cache allocated once per batch and written in place, for self-distillation's batched decoding.

HF's DynamicCache grows every layer's keys and values with ``torch.cat`` on every decode step: an O(T) copy per
token per layer (on SmolLM2-135M, batch 32 on CPU, about a sixth of a step at 100 cached tokens and growing with T).
``SlotLayer`` keeps DynamicCache's contract — the mask and attention see exactly the tokens written so far, so every
logit is the one DynamicCache gives — but writes into buffers sized once for prompt + answer (gpt-fast's rule: never
grow with ``torch.cat`` in the loop). Rows are dropped (``batch_select_indices``) by copying only the filled part.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's keys and values in [B, H, capacity, D] buffers; ``keys``/``values`` are views of the filled part."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, Dk = key_states.shape
        self.device = key_states.device
        self.key_buf = key_states.new_empty(B, H, self.capacity, Dk)
        self.value_buf = value_states.new_empty(B, H, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"SlotLayer holds {self.capacity} tokens, asked to hold {end}: size it for prompt + answer")
        self.key_buf[:, :, self.length:end] = key_states
        self.value_buf[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        for name in ("key_buf", "value_buf"):
            old = getattr(self, name)
            new = old.new_empty(len(indices), *old.shape[1:])
            new[:, :, :self.length] = old[indices, :, :self.length]  # the empty tail is not worth copying
            setattr(self, name, new)
        self.keys, self.values = self.key_buf[:, :, :self.length], self.value_buf[:, :, :self.length]

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False
        self.keys = self.values = None


def slot_cache(model, capacity: int) -> Cache:
    """A cache for ``model`` that holds ``capacity`` tokens per row without ever reallocating."""
    return Cache(layers=[SlotLayer(capacity) for _ in range(model.config.num_hidden_layers)])
