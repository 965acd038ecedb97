"""EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of LLMs via Training-Time Test").

Reads three target hidden states, HF ``hidden_states[k]`` (the input of decoder layer k) for k in
(2, L//2, L-3) by default, the ids vLLM's ``eagle_aux_hidden_state_layer_ids`` use. ``fc`` maps their concatenation
3H -> H. One decoder layer (``midlayer``) whose attention reads ``cat(input_layernorm(embed(x_{t+1})),
hidden_norm(h))`` (2H wide); the residual is the un-normed h (vLLM's ``norm_before_residual: false``). A final norm
and an lm_head over a reduced draft vocabulary: draft id i is target id ``i + d2t[i]``; ``t2d`` marks the target
ids the draft can reach. Drafting feeds the midlayer's pre-norm output back as h (it skips fc). Trained with
training-time test: K unrolled steps, each seeing what drafting will see, loss weights decay^k.

EAGLE 3.1 normalisation (speculators' ``fc_norm`` and ``norm_output``, off by default): ``fc_norm`` RMS-normalises
each of the three target states before ``fc`` (their scales differ by orders of magnitude across depth), and
``norm_output`` feeds the final norm's output back as the next step's h, so its magnitude cannot drift with depth.
"""
from __future__ import annotations

import torch
from torch import nn

from heads.base import TargetDims, most_frequent_tokens, scatter_to_vocab
from heads.eagle import ChainHead
from heads.layers import MLP, Attention, RMSNorm


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


class MidLayer(nn.Module):
    def __init__(self, dims: TargetDims):
        super().__init__()
        H, eps = dims.hidden_size, dims.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(dims, 2 * H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(dims)

    def forward(self, embeds, h, positions, bias=None, cache=None, slots=None, ttt_kv=None):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)  # [B, T, 2H]
        if ttt_kv is not None:
            a = self.self_attn.forward_ttt(x, positions, ttt_kv)
        else:
            a = self.self_attn(x, positions, bias, cache, slots)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3(ChainHead):
    family = "eagle3"

    def __init__(self, dims: TargetDims, num_steps: int = 4, draft_vocab_size: int = 32000,
                 aux_layers: list[int] | None = None, fc_norm: bool = False, norm_output: bool = False):
        super().__init__(dims, num_steps)
        H, L = dims.hidden_size, dims.num_layers
        self.aux_layers = tuple(aux_layers) if aux_layers else default_aux_layers(L)
        if len(self.aux_layers) != 3 or not all(0 <= k < L for k in self.aux_layers):
            raise ValueError(f"eagle3 needs three aux layer ids in [0, {L}); got {list(self.aux_layers)}")
        self.draft_vocab_size = min(draft_vocab_size, dims.vocab_size)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.fc_norm = nn.ModuleList(RMSNorm(H, dims.rms_norm_eps) for _ in range(3)) if fc_norm else None
        self.norm_output = bool(norm_output)
        self.midlayer = MidLayer(dims)
        self.norm = RMSNorm(H, dims.rms_norm_eps)
        self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)
        # Identity map until set_vocab_map() picks the most frequent training tokens.
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(dims.vocab_size, dtype=torch.bool)
        t2d[: self.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def hparams(self) -> dict:
        return {"num_steps": self.num_steps, "draft_vocab_size": self.draft_vocab_size,
                "aux_layers": list(self.aux_layers), "fc_norm": self.fc_norm is not None,
                "norm_output": self.norm_output}

    @property
    def eagle31(self) -> bool:
        """Whether either EAGLE 3.1 normalisation is on (what the eagle3 exports do not write yet)."""
        return self.fc_norm is not None or self.norm_output

    @property
    def feature_layers(self):
        return tuple(self.aux_layers) + (self.dims.num_layers,)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[V_draft] target id of each draft id."""
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    @torch.no_grad()
    def set_vocab_map(self, token_counts: torch.Tensor) -> None:
        """Keep the draft_vocab_size most frequent target tokens (ties broken by id), in target-id order."""
        keep = most_frequent_tokens(token_counts, self.draft_vocab_size, self.dims.vocab_size)
        self.d2t.copy_(keep - torch.arange(self.draft_vocab_size))
        self.t2d.zero_()
        self.t2d[keep] = True

    @torch.no_grad()
    def init_from_target(self) -> None:
        self.lm_head.weight.copy_(self.frozen("lm_head").weight[self.draft_to_target])
        self.norm.weight.copy_(self.frozen("final_norm").weight)

    def to_target_vocab(self, logits):
        return scatter_to_vocab(logits, self.draft_to_target, self.dims.vocab_size)

    def from_target_vocab(self, logits):
        return logits.index_select(-1, self.draft_to_target)

    def fuse(self, hidden):
        parts = [hidden[k] for k in self.aux_layers]
        if self.fc_norm is not None:
            parts = [norm(x) for norm, x in zip(self.fc_norm, parts)]
        return self.fc(torch.cat(parts, dim=-1))  # [B, T, 3H] -> [B, T, H]

    def block(self, h, tokens, positions, **attn):
        embeds = self.frozen("embed_tokens")(tokens).to(h.dtype)
        out = self.midlayer(embeds, h, positions, **attn)  # pre-norm: fed back as the next step's h (EAGLE-3)
        return self.norm(out) if self.norm_output else out  # EAGLE 3.1: post-norm fed back

    def logits(self, out):
        return self.lm_head(out if self.norm_output else self.norm(out))
