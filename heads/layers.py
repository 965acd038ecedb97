"""A Llama decoder layer the heads own, with a position-indexed KV cache.

Parameter names follow HF/vLLM Llama (``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``...), so export
is mostly a prefix change. Why not HF's ``LlamaDecoderLayer``: EAGLE-3's attention reads 2H-wide inputs, EAGLE-1
drops the input norm, and training-time test needs a causal-plus-diagonal mask that HF's layer cannot take.

Masks are additive floats throughout (HF eager attention gets 4D bool masks silently wrong).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import TargetDims


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] for integer positions (HF Llama's half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [..., head_dim/2]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache(nn.Module):
    """Keys/values for one attention layer, indexed by absolute position; allocated once."""

    def __init__(self, max_len: int, num_kv_heads: int, head_dim: int, device, dtype):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, num_kv_heads, max_len, head_dim, device=device, dtype=dtype))
        self.register_buffer("v", torch.zeros(1, num_kv_heads, max_len, head_dim, device=device, dtype=dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if int(slots.max()) >= self.max_len:
            raise ValueError(f"draft cache of {self.max_len} slots is full; raise max_len")
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v


class Attention(nn.Module):
    def __init__(self, dims: TargetDims, in_features: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.rope_theta = dims.rope_theta
        self.q_proj = nn.Linear(in_features, dims.num_heads * dims.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, dims.num_kv_heads * dims.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, dims.num_kv_heads * dims.head_dim, bias=False)
        self.o_proj = nn.Linear(dims.num_heads * dims.head_dim, dims.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nH, T, hd]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nKV, T, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, x.dtype)  # [T, hd] or [B, T, hd]
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def forward(self, x, positions, bias=None, cache: KVCache | None = None, slots=None):
        """Full causal attention (training), or attention over a cache after writing x's keys (drafting).

        positions: rotary positions [T]. slots: cache rows to write (default: the positions; trees put siblings,
        which share a position, in different rows). bias: additive float mask [T, S] over cache rows 0..S-1;
        None means causal by slot.
        """
        q, k, v = self.qkv(x, positions)
        if cache is not None:
            slots = positions if slots is None else slots
            cache.write(slots, k, v)
            S = int(slots.max()) + 1
            k, v = cache.k[:, :, :S], cache.v[:, :, :S]
            if bias is None:  # chain drafting: each query sees every cached row up to its own
                bias = causal_bias(slots, S, x.dtype, x.device)
        k, v = self.expand_kv(k), self.expand_kv(v)
        if bias is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(o)

    def forward_ttt(self, x, positions, past_kv: list):
        """Training-time test step: queries at step j see step-1 keys causally plus the same anchor's keys of
        steps 2..j (the diagonal), exactly what the drafting cache holds at that point.

        past_kv: list of (k, v) from earlier steps, step 1 first; this step's (k, v) are appended.
        """
        q, k, v = self.qkv(x, positions)
        past_kv.append((k, v))
        k1, v1 = self.expand_kv(past_kv[0][0]), self.expand_kv(past_kv[0][1])
        T = x.shape[1]
        scale = self.head_dim**-0.5
        scores = (q @ k1.transpose(-1, -2)) * scale  # [B, nH, T, T]
        scores = scores + causal_bias(torch.arange(T, device=x.device), T, scores.dtype, x.device)
        diag = [(q * self.expand_kv(kj)).sum(-1, keepdim=True) * scale for kj, _ in past_kv[1:]]  # [B,nH,T,1]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        o = probs[..., :T] @ v1
        for j, (_, vj) in enumerate(past_kv[1:]):
            o = o + probs[..., T + j : T + j + 1] * self.expand_kv(vj)
        return self.out(o)


def causal_bias(positions: torch.Tensor, num_keys: int, dtype, device) -> torch.Tensor:
    """[T, S] additive mask: query at position p sees keys 0..p."""
    keys = torch.arange(num_keys, device=device)
    allowed = keys[None, :] <= positions[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


class MLP(nn.Module):
    def __init__(self, dims: TargetDims):
        super().__init__()
        self.gate_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.up_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama block. ``input_norm=False`` gives EAGLE-1's first layer (its input is already fused by fc)."""

    def __init__(self, dims: TargetDims, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(dims, dims.hidden_size)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = MLP(dims)

    def forward(self, x, positions, bias=None, cache=None, slots=None, ttt_kv: list | None = None):
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        if ttt_kv is not None:
            h = self.self_attn.forward_ttt(h, positions, ttt_kv)
        else:
            h = self.self_attn(h, positions, bias, cache, slots)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))
