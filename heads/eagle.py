"""EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty").

Reads the target's final-norm hidden state h_t and the embedding of the token after it. ``fc(cat(embed(x_{t+1}),
h_t))`` (embedding first, [H, 2H], no bias) feeds one Llama decoder layer *without* its input norm; its output f
predicts the target's next feature h_{t+1}, and the target's frozen lm_head turns f into logits for x_{t+2}.
Drafting feeds f back in place of h. Trained with the distillation loss plus EAGLE's feature regression
(smooth L1 against h_{t+1}), unrolled for K steps with training-time test so step k sees what drafting sees.

Loss weights are not EAGLE's. SafeAILab's EAGLE-1 trainer (eagle/train/main.py) minimises 1.0 · smooth-L1 (mean
over H) + 0.1 · soft cross-entropy (summed over V), on one step, with noisy input features; against our weight 1 on
the distillation loss that is feature_loss_weight = 10. On stories260K (3 steps, 150 steps of 16 stories, 9,272
held-out tokens, seed 0) 10 measured greedy α 0.337 / 0.325 / 0.317 against 0.358 / 0.343 / 0.340 for 0.2, so 0.2
stays (one seed, one toy target: not yet repeated on SmolLM2 or with EAGLE's feature noise).

Training may score a reduced vocabulary (``loss_vocab_size``; see ``heads.base.FrequentTokenLoss``): only the
training data's most frequent tokens' rows of the frozen lm_head, in training mode only.

``ChainHead`` holds what EAGLE-1 and EAGLE-3 share: the unrolled training loop and the cached chain drafting.
Subclasses say how target features enter (``fuse``), what one step computes (``block``) and how a step's output
becomes logits (``logits``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead, FrequentTokenLoss, HeadOutput, TargetDims, TargetFeatures
from heads.layers import DecoderLayer, KVCache


def shifted_tokens(input_ids: torch.Tensor, k: int) -> torch.Tensor:
    """x_{t+k} at each position t ([B, T]); the last k positions repeat the final token (never scored)."""
    return torch.cat([input_ids[:, k:], input_ids[:, -1:].expand(-1, k)], dim=1)


class ChainHead(DraftHead):
    """A head with one decoder layer drafted autoregressively (EAGLE-1, EAGLE-3)."""

    layer_attr = "layers"  # where the decoder layer lives; its KV cache is the drafting cache

    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def block(self, h, tokens, positions, **attn) -> torch.Tensor:
        """(state [B, T, H], tokens [B, T]) -> output [B, T, H]: the next step's state and the logits' source."""
        raise NotImplementedError

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, feats: TargetFeatures, num_steps: int | None = None) -> HeadOutput:
        B, T = feats.input_ids.shape
        h = self.fuse(feats.hidden)
        ttt_kv: list = []
        outputs = []
        for k in range(1, (num_steps or self.num_steps) + 1):
            positions = torch.arange(T, device=h.device) + (k - 1)  # step k of anchor t sits at position t+k-1
            h = self.block(h, shifted_tokens(feats.input_ids, k), positions, ttt_kv=ttt_kv)
            outputs.append(h)
        # The decoder layer needs every position (attention); the read-out only the scored ones.
        return HeadOutput(outputs, self.aux_losses(outputs, feats), readout=lambda k, rows: self.logits(rows))

    def aux_losses(self, outputs, feats) -> dict[str, torch.Tensor]:
        return {}

    # -- drafting ------------------------------------------------------------------------------------------
    def new_cache(self, max_len, device, dtype):
        d = self.dims
        return KVCache(max_len, d.num_kv_heads, d.head_dim, device, dtype)

    def commit(self, cache, hidden, next_tokens, start):
        n = next_tokens.shape[1]
        positions = torch.arange(start, start + n, device=next_tokens.device)
        h = self.block(self.fuse(hidden), next_tokens, positions, cache=cache)[:, -1:]
        return self.to_target_vocab(self.logits(h[:, -1])), (h, start + n - 1)

    def step(self, cache, state, token, depth):
        h, pos = state
        positions = torch.tensor([pos + 1], device=h.device)
        h = self.block(h, token.view(1, 1), positions, cache=cache)
        return self.to_target_vocab(self.logits(h[:, -1])), (h, pos + 1)

    def step_tree(self, cache, h, tokens, positions, slots, bias):
        """Draft N tree nodes in one call (EAGLE-2's per-depth expansion); ``step`` is the one-node chain case.

        h [1, N, H]: each node's parent output (``commit``'s state h for the nodes right after the anchor);
        tokens [1, N]: the nodes' tokens; positions [N]: rotary positions (parent's + 1); slots [N]: distinct
        scratch cache rows past the committed length (a CPU tensor spares a host sync); bias [N, S], S =
        max(slots) + 1: additive mask over cache rows, 0 on the committed prefix, the node's ancestors and itself.
        Returns (logits [N, V] over the target vocab, out [1, N, H]: each node's state for its own children).
        """
        out = self.block(h, tokens, positions, cache=cache, slots=slots, bias=bias)
        return self.to_target_vocab(self.logits(out[0])), out


class Eagle(FrequentTokenLoss, ChainHead):
    family = "eagle"

    def __init__(self, dims: TargetDims, num_steps: int = 4, feature_loss_weight: float = 0.2,
                 loss_vocab_size: int | None = None, loss_vocab_sampled: int = 0):
        super().__init__(dims, num_steps)
        self.feature_loss_weight = feature_loss_weight
        self.init_loss_vocab(loss_vocab_size, loss_vocab_sampled)
        self.fc = nn.Linear(2 * dims.hidden_size, dims.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(dims, input_norm=False)])

    def hparams(self) -> dict:
        return {"num_steps": self.num_steps, "feature_loss_weight": self.feature_loss_weight,
                **self.loss_vocab_hparams()}

    def fuse(self, hidden):
        return hidden[self.dims.num_layers]  # [B, T, H]: final-norm output, what the lm_head reads

    def block(self, h, tokens, positions, **attn):
        x = self.fc(torch.cat([self.frozen("embed_tokens")(tokens).to(h.dtype), h], dim=-1))  # [B, T, 2H] -> H
        return self.layers[0](x, positions, **attn)

    def logits(self, out):
        return self.target_lm_head(out)

    def aux_losses(self, outputs, feats):
        if not self.feature_loss_weight:
            return {}
        target_next = feats.hidden[self.dims.num_layers][:, 1:]  # h_{t+1} for anchor t
        mask = feats.loss_mask[:, 1:]
        err = F.smooth_l1_loss(outputs[0][:, :-1][mask], target_next[mask].to(outputs[0].dtype))
        return {"feature_loss": self.feature_loss_weight * err}
