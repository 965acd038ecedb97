"""Multi-token prediction modules, DeepSeek-V3 style (DeepSeek-AI 2024, §2.2 "Multi-Token Prediction").

K sequential modules. Module k at position i reads h^{k-1}_i (h^0 = the target's final-norm hidden state) and the
embedding of x_{i+k}: ``eh_proj(cat(enorm(embed), hnorm(h)))`` (embedding first, 2H -> H), one Llama decoder layer
with causal attention over module k's own sequence, giving h^k_i; logits = the target's lm_head over a shared
``norm`` (in training, optionally only the most frequent tokens' rows: ``loss_vocab_size``). Module k at anchor t
predicts x_{t+1+k}, i.e. draft step k. Drafting is limited to K steps.

Drafting has to match training exactly: module k at position i needs x_{i+k}, so after the target accepts tokens
up to x_{m+1}, module k can commit positions <= m+1-k with real tokens; draft step k recomputes module k over
positions m+2-k..m with drafted tokens (k-1 rows, scratch cache slots) so its attention sees what training saw.
"""
from __future__ import annotations

import torch
from torch import nn

from heads.base import DraftHead, FrequentTokenLoss, HeadOutput, TargetDims, TargetFeatures
from heads.eagle import shifted_tokens
from heads.layers import DecoderLayer, KVCache, RMSNorm


class MtpModule(nn.Module):
    def __init__(self, dims: TargetDims):
        super().__init__()
        H, eps = dims.hidden_size, dims.rms_norm_eps
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = DecoderLayer(dims)

    def forward(self, embeds, h, positions, **attn):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(h)], dim=-1))  # [B, T, 2H] -> [B, T, H]
        return self.layer(x, positions, **attn)


class Mtp(FrequentTokenLoss, DraftHead):
    family = "mtp"

    def __init__(self, dims: TargetDims, num_steps: int = 2, loss_vocab_size: int | None = None,
                 loss_vocab_sampled: int = 0):
        super().__init__(dims, num_steps)
        self.init_loss_vocab(loss_vocab_size, loss_vocab_sampled)  # training-only: heads.base.FrequentTokenLoss
        self.layers = nn.ModuleList(MtpModule(dims) for _ in range(num_steps))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)  # DeepSeek's shared_head.norm

    def hparams(self) -> dict:
        return {"num_steps": self.num_steps, **self.loss_vocab_hparams()}

    @property
    def max_draft_steps(self) -> int:
        return self.num_steps

    @torch.no_grad()
    def init_from_target(self) -> None:
        self.norm.weight.copy_(self.frozen("final_norm").weight)

    def logits(self, h):
        return self.target_lm_head(self.norm(h))

    def embed(self, tokens, dtype):
        return self.frozen("embed_tokens")(tokens).to(dtype)

    def forward(self, feats: TargetFeatures, num_steps: int | None = None) -> HeadOutput:
        T = feats.input_ids.shape[1]
        h = feats.hidden[self.dims.num_layers]
        positions = torch.arange(T, device=h.device)
        states = []
        for k in range(1, (num_steps or self.num_steps) + 1):
            h = self.layers[k - 1](self.embed(shifted_tokens(feats.input_ids, k), h.dtype), h, positions)
            states.append(h)
        return HeadOutput(states, readout=lambda k, rows: self.logits(rows))

    # -- drafting ------------------------------------------------------------------------------------------
    def new_cache(self, max_len, device, dtype):
        d, K = self.dims, self.num_steps
        return {
            "kv": [KVCache(max_len, d.num_kv_heads, d.head_dim, device, dtype) for _ in range(K)],
            "hist": torch.zeros(K + 1, max_len, d.hidden_size, device=device, dtype=dtype),  # h^k_i, k = 0..K
            "tokens": torch.zeros(max_len + 1, dtype=torch.long, device=device),  # real tokens x_i
            "length": [0] * (K + 1),  # committed positions per module (index 0: the target)
        }

    def commit(self, cache, hidden, next_tokens, start):
        n = next_tokens.shape[1]
        m = start + n - 1  # last accepted position; x_{m+1} = next_tokens[0, -1] is known
        hist, length = cache["hist"], cache["length"]
        hist[0, start : m + 1] = hidden[self.dims.num_layers][0]
        cache["tokens"][start + 1 : m + 2] = next_tokens[0]
        length[0] = m + 1
        for k in range(1, self.num_steps + 1):
            lo, hi = length[k], m + 2 - k  # module k commits positions lo..hi-1 (needs x_{i+k} real)
            if hi <= lo:
                continue
            pos = torch.arange(lo, hi, device=next_tokens.device)
            out = self.layers[k - 1](
                self.embed(cache["tokens"][pos + k][None], hist.dtype), hist[k - 1, lo:hi][None], pos,
                cache=cache["kv"][k - 1],
            )
            hist[k, lo:hi] = out[0]
            length[k] = hi
        h1 = hist[1, m : m + 1]  # [1, H] step 1 at anchor m was committed with the real x_{m+1}
        # "prev": module k-1's outputs at positions m+3-k..m from the previous step (none before step 2).
        return self.logits(h1), {"m": m, "drafted": [], "prev": h1[None, :0]}

    def step(self, cache, state, token, depth):
        k, m = depth, state["m"]
        if k > self.num_steps:
            raise ValueError(f"mtp head has {self.num_steps} modules; cannot draft step {k}")
        drafted = state["drafted"] + [token.view(1)]  # x̂_{m+2} .. x̂_{m+k}
        pos = torch.arange(m + 2 - k, m + 1, device=token.device)  # k-1 positions
        h_in = torch.cat([cache["hist"][k - 1, m + 2 - k][None, None], state["prev"]], dim=1)  # [1, k-1, H]
        tokens = torch.cat(drafted)[None]  # x_{p+k} for p in pos
        out = self.layers[k - 1](self.embed(tokens, h_in.dtype), h_in, pos, cache=cache["kv"][k - 1])
        return self.logits(out[:, -1]), {"m": m, "drafted": drafted, "prev": out}
