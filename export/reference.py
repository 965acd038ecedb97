"""Reference forwards that read an export the way an engine does, from the written files only.

Nothing here touches a DraftHead: weights come from the exported tensors (after the engine's own renames), sizes
from the exported config, and the engine-owned pieces (the target's embedding and lm_head, which vLLM, SGLang and
llama.cpp share with the draft) from the target. Drafting follows the engines: step 1 for every anchor in one
causal pass (the draft "prefill"), then for each anchor t a chain of steps k = 2..K at position t+k-1 whose
attention sees the step-1 keys of anchors 0..t plus the chain's own keys, fed the data token x_{t+k} (teacher
forcing, so the result is comparable with the head's training forward, which heads/ proves equal to its drafting).

Everything is computed in float32, batch item by batch item; outputs are target-vocab logits [B, T-K, V] for the
anchors that have all K steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F



def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary (HF Llama, vLLM ``is_neox_style=True``, GGUF after the converter's q/k permute):
    x [heads, n, hd]; dimension i pairs with i + hd/2."""
    hd = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = (positions.double()[:, None] * inv_freq).float()  # [n, hd/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class Layer:
    """One Llama decoder layer's weights, by their HF names without the prefix (``self_attn.q_proj.weight``...)."""

    w: dict[str, torch.Tensor]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    theta: float

    @classmethod
    def read(cls, tensors: dict, prefix: str, cfg: dict) -> "Layer":
        w = {k[len(prefix) + 1 :]: v.float() for k, v in tensors.items() if k.startswith(prefix + ".")}
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        return cls(w, cfg["num_attention_heads"], cfg["num_key_value_heads"], hd, cfg["rms_norm_eps"], theta)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        n = x.shape[0]
        q = (x @ self.w["self_attn.q_proj.weight"].T).view(n, self.num_heads, self.head_dim).transpose(0, 1)
        k = (x @ self.w["self_attn.k_proj.weight"].T).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = (x @ self.w["self_attn.v_proj.weight"].T).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return rope(q, positions, self.theta), rope(k, positions, self.theta), v  # [heads, n, hd]

    def attend(self, x, positions, past=None):
        """Attention of rows x (causal among themselves) over ``past`` keys/values (all visible) plus their own.

        Returns (output [n, H], (k, v) of these rows) so a caller can keep them as the draft's KV cache.
        """
        q, k, v = self.qkv(x, positions)
        keys = k if past is None else torch.cat([past[0], k], dim=1)
        values = v if past is None else torch.cat([past[1], v], dim=1)
        n, P = x.shape[0], keys.shape[1] - x.shape[0]
        allowed = torch.ones(n, P + n, dtype=torch.bool).tril(P)  # row i sees past and own rows <= i
        rep = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0),
            attn_mask=torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")),
        )
        o = o.transpose(0, 1).reshape(n, self.num_heads * self.head_dim) @ self.w["self_attn.o_proj.weight"].T
        return o, (k, v)

    def block(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A standard pre-norm layer with causal attention over its own rows (MTP modules)."""
        a, _ = self.attend(rms(x, self.w["input_layernorm.weight"], self.eps), positions)
        return self.mlp_residual(x + a)

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        x = rms(h, self.w["post_attention_layernorm.weight"], self.eps)
        gate, up = x @ self.w["mlp.gate_proj.weight"].T, x @ self.w["mlp.up_proj.weight"].T
        return h + (F.silu(gate) * up) @ self.w["mlp.down_proj.weight"].T


def chain(step, logits_fn, h0: torch.Tensor, ids: torch.Tensor, K: int) -> list[torch.Tensor]:
    """Engine-style chain drafting for one sequence.

    step(h [n, H], tokens [n], positions [n], past) -> (out [n, H], kv); logits_fn(out) -> [n, V].
    Returns K tensors [T-K, V]: step k at anchors 0..T-1-K.
    """
    T = ids.shape[0]
    next_tokens = torch.cat([ids[1:], ids[-1:]])  # x_{t+1} at anchor t (the last one is never scored)
    out, kv1 = step(h0, next_tokens, torch.arange(T), None)  # the draft's prefill
    results = [logits_fn(out[: T - K])]
    later = [[] for _ in range(K - 1)]
    for t in range(T - K):
        h, past = out[t : t + 1], (kv1[0][:, : t + 1], kv1[1][:, : t + 1])
        for k in range(2, K + 1):
            h, kv = step(h, ids[t + k : t + k + 1], torch.tensor([t + k - 1]), past)
            past = (torch.cat([past[0], kv[0]], 1), torch.cat([past[1], kv[1]], 1))
            later[k - 2].append(logits_fn(h))
    return results + [torch.cat(rows) for rows in later]


def per_sequence(fn, feats) -> list[torch.Tensor]:
    """Run fn(b) -> list of K [n, V] for each batch item; stack to K tensors [B, n, V]."""
    outs = [fn(b) for b in range(feats.input_ids.shape[0])]
    return [torch.stack([o[k] for o in outs]) for k in range(len(outs[0]))]


def eagle1(tensors: dict, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor, feats, K: int, final: int,
           layer_prefix: str = "layers.0"):
    """EAGLE-1 as vLLM's llama_eagle.py / SGLang's llama_eagle.py / SafeAILab's cnets1.py compute it:
    fc(cat(embed(x_{t+1}), h_t)) [+ fc bias], one layer without input norm, no final norm, the target's lm_head."""
    layer = Layer.read(tensors, layer_prefix, cfg)
    fc_w, fc_b = tensors["fc.weight"].float(), tensors.get("fc.bias")

    def step(h, tokens, positions, past):
        x = torch.cat([embed[tokens], h], dim=-1) @ fc_w.T  # [n, 2H] -> [n, H]
        if fc_b is not None:
            x = x + fc_b.float()
        a, kv = layer.attend(x, positions, past)
        return layer.mlp_residual(x + a), kv

    return per_sequence(lambda b: chain(step, lambda h: h @ lm_head.T, feats.hidden[final][b].float(),
                                        feats.input_ids[b], K), feats)


def eagle3(tensors: dict, cfg: dict, embed: torch.Tensor, aux_order: list[int], norm_before_residual: bool,
           feats, K: int, layer_prefix: str, d2t_key: str | None = "d2t"):
    """EAGLE-3 as vLLM's llama_eagle3.py (and SGLang's, llama.cpp's eagle3.cpp) computes it: fc over the aux hidden
    states concatenated in ``aux_order`` (the engine's capture order), one layer reading cat(input_layernorm(embed),
    hidden_norm(h)) with residual h (or hidden_norm(h) when norm_before_residual), final norm, the draft lm_head,
    then draft id i -> target id i + d2t[i] with -inf elsewhere. The pre-norm output is fed back; EAGLE 3.1
    (``cfg["norm_output"]``) feeds the post-norm one back and reads logits from it, and ``fc_norm.{i}.weight``
    RMS-normalise each aux block before fc."""
    layer = Layer.read(tensors, layer_prefix, cfg)
    H, V, eps = cfg["hidden_size"], cfg["vocab_size"], cfg["rms_norm_eps"]
    fc_w, norm_w = tensors["fc.weight"].float(), tensors["norm.weight"].float()
    head_w = tensors["lm_head.weight"].float()
    Vd = head_w.shape[0]
    targets = torch.arange(Vd) + (tensors[d2t_key].long() if d2t_key and d2t_key in tensors else 0)
    fc_norms = None
    if "fc_norm.0.weight" in tensors:
        fc_norms = [tensors[f"fc_norm.{i}.weight"].float() for i in range(len(aux_order))]
    norm_output = bool(cfg.get("norm_output", False))

    def step(h, tokens, positions, past):
        hn = rms(h, layer.w["hidden_norm.weight"], eps)
        x = torch.cat([rms(embed[tokens], layer.w["input_layernorm.weight"], eps), hn], dim=-1)  # [n, 2H]
        a, kv = layer.attend(x, positions, past)
        out = layer.mlp_residual((hn if norm_before_residual else h) + a)
        return (rms(out, norm_w, eps) if norm_output else out), kv

    def logits(h):
        out = torch.full((h.shape[0], V), float("-inf"))
        out[:, targets] = (h if norm_output else rms(h, norm_w, eps)) @ head_w.T
        return out

    def run(b):
        blocks = [feats.hidden[k][b].float() for k in aux_order]
        if fc_norms is not None:
            blocks = [rms(x, g, eps) for x, g in zip(blocks, fc_norms)]
        aux = torch.cat(blocks, dim=-1)  # [T, 3H]
        return chain(step, logits, aux @ fc_w.T, feats.input_ids[b], K)

    assert fc_w.shape[1] == len(aux_order) * H, "fc width does not match the captured layers"
    return per_sequence(run, feats)


def medusa(blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]], lm_heads: list[torch.Tensor], feats,
           final: int, K: int):
    """Medusa head k: x + SiLU(W x + b) per block layer over the final-norm hidden state, then its own lm_head."""
    h0 = feats.hidden[final].float()  # [B, T, H]
    outs = []
    for layers, head in zip(blocks, lm_heads):
        x = h0
        for w, b in layers:
            x = x + F.silu(x @ w.float().T + (b.float() if b is not None else 0))
        outs.append((x @ head.float().T)[:, : h0.shape[1] - K])
    return outs


def mtp(tensors: dict, cfg: dict, feats, K: int):
    """DeepSeek-V3 MTP (its modeling and vLLM's deepseek_mtp.py): module k = model.layers.{L+k-1} reads
    eh_proj(cat(enorm(embed(x_{i+k})), hnorm(h^{k-1}_i))), runs its decoder layer causally over the sequence, and
    predicts with shared_head.head(shared_head.norm(h^k)); h^0 is the target's final-norm hidden state. Every
    tensor, the embedding and lm_head included, comes from the module's own keys."""
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]

    def run(b):
        ids, h = feats.input_ids[b], feats.hidden[L][b].float()
        T, outs = ids.shape[0], []
        for k in range(1, K + 1):
            p = f"model.layers.{L + k - 1}"
            w = {n[len(p) + 1 :]: v.float() for n, v in tensors.items() if n.startswith(p + ".")}
            tokens = torch.cat([ids[k:], ids[-1:].expand(k)])  # x_{i+k} (tail never scored)
            e = rms(w["embed_tokens.weight"][tokens], w["enorm.weight"], eps)
            x = torch.cat([e, rms(h, w["hnorm.weight"], eps)], dim=-1) @ w["eh_proj.weight"].T  # [T, 2H] -> [T, H]
            h = Layer.read(tensors, p, cfg).block(x, torch.arange(T))
            outs.append((rms(h, w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T)[: T - K])
        return outs

    return per_sequence(run, feats)
