"""A KV cache whose rows hold sequences of different lengths, for self-distillation's continuous batching.

A batch of prompts padded to one length wastes work twice: prefill computes every pad token (the training
prompts' lengths spread from ~40 to ~1000 tokens, so a sorted batch of 32 still prefilled ~3.6 pad tokens per real
one), and every row waits for the batch's longest answer. ``RowCache`` gives each row its own length instead:

- a prompt is prefilled alone (no padding: the exact computation a one-prompt run does) and copied into a free row
  with ``put``, so a row whose answer ended takes the next prompt while the others keep decoding;
- a decode step writes each row's new key/value at that row's own length, and ``begin_step`` builds the float mask
  that lets row r see its first ``length[r] + 1`` slots (float, not bool: HF Llama's eager attention mis-reads
  4-D bool masks). Slots past a row's length hold finite leftovers that the mask zeroes out.

Buffers are [B, H, capacity, D], written in place (gpt-fast's rule: never grow with ``torch.cat`` per token); the
capacity grows only when a longer prompt arrives, which happens rarely since prompts come sorted by length.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class RowLayer(DynamicLayer):
    """One layer's buffers; reads the write positions and span of the step from its ``RowCache``."""

    def __init__(self, owner: RowCache):
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        if key_states.shape[-2] != 1:
            raise ValueError("RowCache decodes one token per row per step; prefill a prompt alone and put() it")
        # [B, H, 1, D] -> buffer[b, :, write_at[b]] for every row b at once
        self.key_buf[o.row_idx, :, o.write_at] = key_states[:, :, 0]
        self.value_buf[o.row_idx, :, o.write_at] = value_states[:, :, 0]
        self.keys, self.values = self.key_buf[:, :, :o.span], self.value_buf[:, :, :o.span]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return max(self.owner.lengths, default=0)


class RowCache(Cache):
    """``rows`` sequences, row r holding ``lengths[r]`` tokens (0: free). Positions run 0..length-1 in every row."""

    def __init__(self, model, rows: int):
        c = model.config
        self.heads = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        super().__init__(layers=[RowLayer(self) for _ in range(c.num_hidden_layers)])
        self.lengths = [0] * rows
        self.capacity = 0
        self._allocate(rows, 0)

    def _allocate(self, rows: int, capacity: int, keep: list[int] | None = None) -> None:
        """New zeroed buffers (zeros: a masked slot must never hold NaN, 0 * NaN is NaN) holding ``keep``'s rows."""
        filled = max(self.lengths, default=0)
        for layer in self.layers:
            for name in ("key_buf", "value_buf"):
                new = torch.zeros(rows, self.heads, capacity, self.head_dim, dtype=self.dtype, device=self.device)
                if keep is not None and filled:
                    new[:, :, :filled] = getattr(layer, name)[keep, :, :filled]
                setattr(layer, name, new)
        self.capacity = capacity
        self.row_idx = torch.arange(rows, device=self.device)

    def put(self, row: int, prefix: Cache, room: int) -> None:
        """Row ``row`` takes a one-sequence cache ``prefix`` (a prompt's prefill), with ``room`` slots to decode."""
        n = prefix.get_seq_length()
        if n + room > self.capacity:  # a longer prompt than any before: grow, rounded up so growth is rare
            self._allocate(len(self.lengths), -(-(n + room) // 64) * 64, keep=list(range(len(self.lengths))))
        for layer, src in zip(self.layers, prefix.layers):
            layer.key_buf[row, :, :n] = src.keys[0]
            layer.value_buf[row, :, :n] = src.values[0]
        self.lengths[row] = n

    def free(self, row: int) -> None:
        """The row's sequence is done: it decodes padding at slot 0 until it is refilled or dropped."""
        self.lengths[row] = 0

    def select(self, keep: list[int]) -> None:
        """Only rows ``keep`` stay (copies the filled part: worth it once many rows are free and none will refill)."""
        self._allocate(len(keep), self.capacity, keep=keep)
        self.lengths = [self.lengths[r] for r in keep]

    def begin_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids [B, 1] and float mask [B, 1, 1, S] for one decode step; each row writes at its length."""
        self.write_at = torch.tensor(self.lengths, device=self.device)
        self.span = max(self.lengths) + 1
        visible = torch.arange(self.span, device=self.device)[None, :] <= self.write_at[:, None]  # [B, S]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return self.write_at[:, None], mask[:, None, None, :]

    def end_step(self) -> None:
        """Every occupied row now holds the token it just read; free rows stay empty."""
        self.lengths = [n + 1 if n else 0 for n in self.lengths]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)
