"""The contract every draft head keeps: target features in, draft logits out.

Alignment, the one convention everything else relies on
--------------------------------------------------------
Position t of a sequence is an *anchor*: the target has read tokens x_0..x_t, and the token x_{t+1} is known (in
serving it is the token the target itself just emitted; in training it is the data token). Draft step k (1-based)
at anchor t predicts token x_{t+1+k}. Its reference distribution is therefore the target's next-token distribution
at position t+k, i.e. ``target_logits[:, t + k]``. Step k is only defined for anchors t <= T - 1 - k.

So ``HeadOutput.logits[k-1][:, t]`` is compared with ``target_logits[:, t + k]``; ``heads.losses.shift_pair`` does
that slicing once for the loss, for α and for the tests.

Logits are read out late
------------------------
A head's forward returns, per step, the features its logits are read from (``states``) and the read-out itself
(``readout``: lm_head, norm + lm_head, ...). The loss applies the read-out only to the rows it scores: on a 49k
vocabulary the [B, T, V] logits of prompt and padding positions, and their gradients, were most of a training
step. ``HeadOutput.logits`` still gives every position's logits for the callers that want them all.

Drafting
--------
Serving drafts one anchor at a time with a cache the head owns. ``commit`` writes the newly accepted positions
(with their target features and the token that followed each) into the cache and returns the state of draft step 1
at the last of them; ``step`` then runs step k >= 2 from the previous step's output and the drafted token. Both
return logits over the *target* vocabulary (``-inf`` where a reduced draft vocabulary cannot reach), so serve/
never special-cases a family. Cache slots past the committed length are scratch: the next ``commit`` overwrites
them, which is how rejected drafts are rolled back.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn


def most_frequent_tokens(token_counts: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
    """[k] target ids of the k most frequent tokens (ties broken by lower id), sorted by id."""
    if token_counts.numel() != vocab_size:
        raise ValueError(f"token_counts has {token_counts.numel()} entries, target vocab is {vocab_size}")
    return torch.topk(token_counts.double() - torch.arange(vocab_size) * 1e-9, k).indices.sort().values


def linear_rows(linear: nn.Linear, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(h)``, or only the outputs ``rows`` (ids of the weight's rows): a vocabulary projection computing just
    the tokens a loss reads (8k of SmolLM2's 49k columns cost a sixth of the full lm_head)."""
    if rows is None:
        return linear(h)
    b = linear.bias
    return F.linear(h, linear.weight.index_select(0, rows), None if b is None else b[rows])


def scatter_to_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [..., len(ids)] over target ids ``ids`` -> [..., vocab_size], -inf at every other id."""
    return logits.new_full((*logits.shape[:-1], vocab_size), float("-inf")).index_copy(-1, ids, logits)


class FrequentTokenLoss:
    """Mixin for heads whose logits come from a full-vocabulary lm_head (EAGLE-1 and MTP: the target's frozen one;
    Medusa: its own trained ones): ``loss_vocab_size`` lets the training loss score only the training data's most
    frequent tokens, plus ``loss_vocab_sampled`` others drawn at random every training step.

    In training mode the read-out uses only those rows of the lm_head, and the soft cross-entropy is taken against the
    target's distribution renormalised to them, as EAGLE-3's reduced draft vocabulary is trained. On a CPU the full
    49k-row lm_head forward and backward at every step is most of such a head's step
    (docs/results/training-and-scaling.md). Eval mode (held-out α, drafting, every export) reads the full lm_head, so
    the head can still draft any token and its weights are the same either way. That is only safe if nothing drives the
    never-scored tokens' logits up: EAGLE-1's feature regression keeps its output where the target's features live, but
    MTP's output is free, and with the 8k most frequent tokens alone its held-out α₁ fell to 0.034 against 0.206 for the
    full vocabulary (docs/results/training-and-scaling.md). The sampled tokens (sampled-softmax negatives) put every
    other token under the loss now and then. A trained lm_head (Medusa) then also gets gradient on every row now and
    then, and only on those rows each step. The index buffers are not saved: ``set_vocab_map`` rebuilds them from the
    same data on a resume, and exports carry only what drafting reads. Call ``init_loss_vocab`` in ``__init__``; the
    training loop calls ``resample_loss_vocab(global_step)`` before each step.
    """

    dims: "TargetDims"
    training: bool

    def init_loss_vocab(self, loss_vocab_size: int | None, loss_vocab_sampled: int = 0) -> None:
        V = self.dims.vocab_size
        if (loss_vocab_size is not None and loss_vocab_size < 1) or loss_vocab_sampled < 0:
            raise ValueError(f"loss_vocab_size must be >= 1 (or null) and loss_vocab_sampled >= 0; got "
                             f"{loss_vocab_size}, {loss_vocab_sampled}")
        if loss_vocab_sampled and not loss_vocab_size:
            raise ValueError("loss_vocab_sampled adds tokens to a reduced loss vocabulary: set "
                             "head.hparams.loss_vocab_size too (e.g. 8192), or loss_vocab_sampled=0")
        self.loss_vocab_size = min(loss_vocab_size or V, V)
        self.loss_vocab_sampled = min(loss_vocab_sampled, V - self.loss_vocab_size)
        self.register_buffer("frequent_vocab", torch.arange(self.loss_vocab_size), persistent=False)
        self.register_buffer("loss_vocab", torch.arange(self.loss_vocab_size + self.loss_vocab_sampled),
                             persistent=False)  # target ids the loss scores this step, sorted

    def loss_vocab_hparams(self) -> dict:
        return {"loss_vocab_size": self.loss_vocab_size, "loss_vocab_sampled": self.loss_vocab_sampled}

    @torch.no_grad()
    def set_vocab_map(self, token_counts: torch.Tensor) -> None:
        """Score the loss_vocab_size most frequent training tokens (all of them by default)."""
        self.frequent_vocab.copy_(most_frequent_tokens(token_counts, self.loss_vocab_size, self.dims.vocab_size))
        self.resample_loss_vocab()

    @torch.no_grad()
    def resample_loss_vocab(self, step: int = 0) -> None:
        """The frequent tokens plus a uniform draw of loss_vocab_sampled of the others, a function of ``step`` alone
        (a generator seeded with it): a resumed run and every DDP rank draw what an uninterrupted run draws."""
        picked = self.frequent_vocab
        if self.loss_vocab_sampled:
            rest = torch.ones(self.dims.vocab_size, dtype=torch.bool)
            rest[picked.cpu()] = False
            rest = rest.nonzero().squeeze(1)
            draw = torch.randperm(rest.numel(), generator=torch.Generator().manual_seed(step))
            picked = torch.cat([picked, rest[draw[: self.loss_vocab_sampled]].to(picked.device)]).sort().values
        self.loss_vocab.copy_(picked)

    def reduced_loss_vocab(self) -> bool:
        return self.training and self.loss_vocab.numel() < self.dims.vocab_size

    def to_target_vocab(self, logits):
        return scatter_to_vocab(logits, self.loss_vocab, self.dims.vocab_size) if self.reduced_loss_vocab() else logits

    def from_target_vocab(self, logits):
        return logits.index_select(-1, self.loss_vocab) if self.reduced_loss_vocab() else logits

    def vocab_linear(self, linear: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        """``linear(h)`` for a vocabulary projection; in training, only the loss vocabulary's rows are computed."""
        return linear_rows(linear, h, self.loss_vocab if self.reduced_loss_vocab() else None)

    def target_lm_head(self, h: torch.Tensor) -> torch.Tensor:
        lm_head = self.frozen("lm_head")  # in the lm_head's dtype, as DraftHead's
        return self.vocab_linear(lm_head, h.to(lm_head.weight.dtype)).to(h.dtype)


@dataclass
class TargetDims:
    """What a head must know about its target to be built; read from the target's HF config."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048


@dataclass
class TargetFeatures:
    """One batch as the frozen target sees it.

    hidden: HF ``hidden_states[k]`` for each requested k (the *input* of decoder layer k; k = num_layers is the
    output of the final norm, which is also what the target's lm_head reads).
    """

    input_ids: torch.Tensor  # [B, T] long
    hidden: dict[int, torch.Tensor]  # k -> [B, T, H]
    target_logits: torch.Tensor  # [B, T, V] the target's next-token logits (float32), or [N, V]: only the N
    # positions loss_mask holds, in its boolean-index order (the feature cache's path builds no dense tensor)
    loss_mask: torch.Tensor  # [B, T] bool: position t's *next* token x_{t+1} is trained/evaluated on
    attention_mask: torch.Tensor | None = None  # [B, T] 1 for real tokens (right padding only)
    logit_columns: torch.Tensor | None = None  # target ids of target_logits' columns where only those were computed
    # (training steps that log no α: the loss reads the draft vocabulary alone); None: all V

    def scored_target_logits(self, k: int = 0) -> torch.Tensor:
        """[N_k, V]: the target's logits at the positions t >= k that loss_mask holds, in the row order of
        ``target_logits[:, k:][loss_mask[:, k:]]`` (what step k of a head is scored against)."""
        if self.target_logits.dim() == 3:
            return self.target_logits[:, k:][self.loss_mask[:, k:]]
        if k == 0:
            return self.target_logits
        return self.target_logits[self.loss_mask.nonzero()[:, 1] >= k]

    def hidden_as(self, dtype: torch.dtype) -> "TargetFeatures":
        """The same batch with the hidden states in ``dtype``: the one place a bf16/fp16 target's features meet
        an fp32 head (training, α and export all pass through here; serve/ casts the head to the target instead).
        """
        if all(h.dtype == dtype for h in self.hidden.values()):
            return self
        return replace(self, hidden={k: h.to(dtype) for k, h in self.hidden.items()})


@dataclass
class HeadOutput:
    states: list[torch.Tensor]  # K tensors [B, T, *]: what step k's logits at anchor t are read from
    aux: dict[str, torch.Tensor] = field(default_factory=dict)  # extra losses, already reduced (e.g. feature L1)
    readout: Callable[[int, torch.Tensor], torch.Tensor] | None = None  # (k, rows [..., *]) -> [..., V_draft];
    # None: the states already are logits

    def step_logits(self, k: int, rows: torch.Tensor) -> torch.Tensor:
        """Draft step k's (1-based) logits [..., V_draft] for ``rows`` [..., *] picked from ``states[k-1]``."""
        return rows if self.readout is None else self.readout(k, rows)

    @cached_property
    def logits(self) -> list[torch.Tensor]:
        """K tensors [B, T, V_draft] (every position): step k at anchor t predicts x_{t+1+k}."""
        return [self.step_logits(k, s) for k, s in enumerate(self.states, start=1)]


class DraftHead(nn.Module):
    """Base class. Subclasses set ``family`` and implement ``forward``, ``commit``, ``step``.

    Frozen target modules (embedding, lm_head, final norm) are *attached*, not owned: they are kept outside the
    module tree so they never enter the head's state dict, optimizer or checkpoint.
    """

    family: ClassVar[str] = ""

    def __init__(self, dims: TargetDims, num_steps: int):
        super().__init__()
        self.dims = dims
        self.num_steps = num_steps  # K: draft steps trained and evaluated
        self._frozen: dict[str, nn.Module] = {}

    # -- target wiring -------------------------------------------------------------------------------------
    def attach_target(self, target) -> None:
        """Wire in the frozen target's modules: a heads.target.Target (or anything with embed_tokens, lm_head
        and final_norm)."""
        self.attach_modules(target.embed_tokens, target.lm_head, target.final_norm)

    def attach_modules(self, embed_tokens: nn.Module, lm_head: nn.Module, final_norm: nn.Module) -> None:
        """The same from modules named one by one: another runner's own (serve/), or a lm_head sliced or shared."""
        self._frozen = {"embed_tokens": embed_tokens, "lm_head": lm_head, "final_norm": final_norm}

    def frozen(self, name: str) -> nn.Module:
        if name not in self._frozen:
            raise RuntimeError(f"{type(self).__name__}: call attach_target(target) before using the head")
        return self._frozen[name]

    def target_lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """The frozen lm_head on the head's features, in the lm_head's own dtype (a bf16 target's lm_head takes
        an fp32 head's output cast down; gradients flow through the cast), logits back in the head's dtype."""
        lm_head = self.frozen("lm_head")
        return lm_head(h.to(lm_head.weight.dtype)).to(h.dtype)

    def init_from_target(self) -> None:
        """Copy what a fresh head starts from out of the attached target (lm_head rows, norms). Default: nothing."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Which HF ``hidden_states`` indices this head reads (num_layers = final-norm output)."""
        return (self.dims.num_layers,)

    def hparams(self) -> dict:
        """Constructor kwargs beyond dims, saved in the checkpoint so the registry can rebuild the head."""
        return {"num_steps": self.num_steps}

    # -- vocabulary ----------------------------------------------------------------------------------------
    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., V_draft] -> target-vocab logits [..., V] (-inf where unreachable)."""
        return logits

    def from_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits [..., V] -> the draft vocabulary's columns [..., V_draft]."""
        return logits

    def draft_token_ids(self, device=None) -> torch.Tensor:
        """[V_draft] the target id of each draft-vocabulary column (every id for a full-vocabulary head)."""
        return self.from_target_vocab(torch.arange(self.dims.vocab_size, device=device))

    @property
    def max_draft_steps(self) -> int | None:
        """Deepest chain the head can draft (None: unbounded, it feeds its own output back)."""
        return None

    # -- training ------------------------------------------------------------------------------------------
    def forward(self, feats: TargetFeatures, num_steps: int | None = None) -> HeadOutput:
        raise NotImplementedError

    # -- drafting ------------------------------------------------------------------------------------------
    def new_cache(self, max_len: int, device: torch.device | str, dtype: torch.dtype):
        """Per-sequence drafting state (batch 1). Sized once; never grown in the decode loop."""
        raise NotImplementedError

    def commit(self, cache, hidden: dict[int, torch.Tensor], next_tokens: torch.Tensor, start: int):
        """Append accepted positions start..start+n-1 to the cache.

        hidden: k -> [1, n, H] target features at those positions; next_tokens: [1, n] the token after each.
        Returns (logits [1, V] over the target vocab for draft step 1 at the last position, state) where state
        is whatever ``step`` needs to continue the chain.
        """
        raise NotImplementedError

    def step(self, cache, state, token: torch.Tensor, depth: int):
        """Draft step ``depth`` (>= 2) after drafting ``token`` ([1] long) at step depth-1.

        Returns (logits [1, V] over the target vocab, new state). Writes only scratch cache slots.
        """
        raise NotImplementedError
