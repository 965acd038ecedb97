"""Distillation losses and the acceptance rate α, defined once.

α for one position is Σ_x min(p(x), q(x)) = 1 - TV(p, q): the probability that speculative sampling accepts a
token drawn from q when the target's distribution is p (Leviathan et al. 2023). Training's metric and serve/'s
measured acceptance are the same quantity, so both come from here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from heads.base import HeadOutput, TargetFeatures
from heads.sampling import probs_from_logits


def shift_pair(draft: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, k: int):
    """Align draft step k (anchor t) with the target at t + k; see heads.base for the convention.

    draft [B, T, V], target_logits [B, T, V], mask [B, T] -> (draft [B, T-k, V], target [B, T-k, V], mask [B, T-k]).
    The mask of the *predicted* token decides (position t+k's next token must be a trained token).
    """
    return draft[:, :-k], target_logits[:, k:], mask[:, k:]


def alpha(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """[..., V] x [..., V] -> [...]: Σ_x min(p, q)."""
    return torch.minimum(target_probs, draft_probs).sum(-1)


def alpha_of_logits(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[N, V] x [N, V] -> [N]: α after the same temperature / top-k / top-p processing of both. At T = 0 both are
    one-hot argmaxes, so Σ min(p, q) is 1 exactly where the argmaxes agree: compared directly, without two [N, V]
    one-hots, which were two thirds of a held-out check's time on the 49k-token SmolLM2 vocabulary."""
    if temperature <= 0:
        return (target_logits.argmax(-1) == draft_logits.argmax(-1)).float()
    return alpha(probs_from_logits(target_logits, temperature, top_k, top_p),
                 probs_from_logits(draft_logits, temperature, top_k, top_p))


def scored_logits(out: HeadOutput, mask: torch.Tensor, k: int) -> torch.Tensor:
    """Draft step k's logits [N, V_draft] at the anchors whose predicted token is scored (``shift_pair``'s mask),
    read out only there. Rows in the order of ``target[:, k:][mask[:, k:]]``."""
    return out.step_logits(k, out.states[k - 1][:, :-k][mask[:, k:]])


LOSS_KINDS = ("soft_ce", "kl", "tv", "lk", "lk_alpha")


def distill_loss(draft_logits, target_probs, kind: str = "soft_ce", lk_eta: float = 3.0):
    """Per-position loss [N] between draft logits and the target's next-token probabilities (rows of [N, V]).

    ``lk`` and ``lk_alpha`` are the LK losses (Samarin et al. 2026, arXiv 2602.23881), which optimise α itself:
    ``lk_alpha`` is -log α, whose gradient is TV's scaled by 1/α (TV alone barely moves a cold draft); ``lk`` blends
    λ·KL + (1-λ)·TV with λ = exp(-η·α) and α detached, so a poor draft learns from KL and a good one from TV.
    """
    if kind == "soft_ce":  # the same values as -(p * log_softmax).sum(-1); the clamp it used to take (against -inf
        # logits, which a linear head never gives) cost ~40% of the loss's forward and backward
        return F.cross_entropy(draft_logits.float(), target_probs, reduction="none")
    draft_logp = draft_logits.float().log_softmax(-1)
    if kind == "kl":
        return F.kl_div(draft_logp, target_probs, reduction="none", log_target=False).sum(-1)
    if kind in ("tv", "lk", "lk_alpha"):
        overlap = alpha(target_probs, draft_logp.exp())
        if kind == "tv":
            return 1 - overlap
        if kind == "lk_alpha":
            return -overlap.clamp_min(1e-5).log()
        kl = F.kl_div(draft_logp, target_probs, reduction="none", log_target=False).sum(-1)
        weight = torch.exp(-lk_eta * overlap.detach())
        return weight * kl + (1 - weight) * (1 - overlap)
    raise ValueError(f"unknown loss {kind!r}; choose one of {LOSS_KINDS}")


def head_loss(head, out: HeadOutput, feats: TargetFeatures, kind: str = "soft_ce", step_decay: float = 1.0,
              temperature: float = 1.0):
    """Masked mean loss per step, weighted step_decay**(k-1), and α per step at ``temperature``.

    Returns (loss, {"loss@k": ..., "alpha@k": ..., "count@k": ...} for k = 1..K, plus aux losses).
    Only scored rows are ever built: the draft's logits (``scored_logits``) and the target's soft labels, the
    latter once for all steps (step k reads position s's target for s >= k, the same rows every step).
    α here equals ``alpha_sums``' (q is zero outside a reduced draft vocabulary, so Σ_x min(p, q) only needs p on
    the draft columns and the target's full normaliser). Features whose target logits hold only the draft columns
    (``feats.logit_columns``) give the loss alone: α needs the full vocabulary's argmax or normaliser.
    """
    total = 0.0
    stats: dict[str, torch.Tensor] = {}
    mask = feats.loss_mask
    cols = head.draft_token_ids(feats.target_logits.device)  # [V_draft] target ids
    with_alpha = feats.logit_columns is None
    if not with_alpha and not torch.equal(feats.logit_columns, cols):
        raise ValueError("the target's logits were computed for other columns than the head's draft vocabulary; "
                         "compute them with columns=head.draft_token_ids() or for all columns")
    position = mask.nonzero()[:, 1]  # [N] position of each scored row, in boolean-indexing order
    scored = feats.scored_target_logits().float()  # [N, V], or [N, V_draft] (logit_columns)
    with torch.no_grad():
        # A reduced draft vocabulary learns the target's distribution restricted (renormalised) to that vocabulary.
        target_draft = scored if scored.shape[-1] == cols.numel() else scored.index_select(-1, cols)  # [N, V_draft]
        target_probs = target_draft.softmax(-1)
        if with_alpha and temperature > 0:  # p on the draft columns over the full-vocab normaliser
            alpha_probs = (target_draft / temperature - (scored / temperature).logsumexp(-1, keepdim=True)).exp()
        elif with_alpha:
            best = scored.argmax(-1)  # [N]
    for k in range(1, len(out.states) + 1):
        rows = position >= k  # [N] the scored positions step k predicts (anchor = position - k >= 0)
        count = rows.sum()
        if count == 0:
            continue
        draft = scored_logits(out, mask, k)  # [count, V_draft]
        step_loss = distill_loss(draft, target_probs[rows], kind).mean()
        total = total + step_decay ** (k - 1) * step_loss
        stats[f"loss@{k}"] = step_loss.detach()
        if with_alpha:
            with torch.no_grad():
                if temperature > 0:
                    a = alpha(alpha_probs[rows], (draft.detach().float() / temperature).softmax(-1))
                else:
                    a = (cols[draft.argmax(-1)] == best[rows]).float()
            stats[f"alpha@{k}"] = a.mean()
        stats[f"count@{k}"] = count
    for name, value in out.aux.items():
        total = total + value
        stats[name] = value.detach()
    return total, stats


def full_vocab_loss(head, out: HeadOutput, feats: TargetFeatures, kind: str = "soft_ce", step_decay: float = 1.0):
    """The distillation loss of ``head_loss`` written the plain way: every position's logits, the target's
    softmax per step, then the mask. ``head_loss`` must equal it; tests and `bench vocab` hold it
    as the reference (it is what training computed before logits were read out late)."""
    total = 0.0
    for k, logits in enumerate(out.logits, start=1):
        draft, target, mask = shift_pair(logits, head.from_target_vocab(feats.target_logits), feats.loss_mask, k)
        if mask.any():
            step = distill_loss(draft[mask], target[mask].float().softmax(-1), kind).mean()
            total = total + step_decay ** (k - 1) * step
    return sum(out.aux.values(), total)


@torch.no_grad()
def alpha_sums(head, out: HeadOutput, feats: TargetFeatures, temperature=0.0, top_k=0, top_p=1.0):
    """Σ α and token count per step over target-vocab distributions, for exact held-out aggregation."""
    sums, counts = [], []
    for k in range(1, len(out.states) + 1):
        mask = feats.loss_mask[:, k:]
        draft, target = head.to_target_vocab(scored_logits(out, feats.loss_mask, k)), feats.scored_target_logits(k)
        a = alpha_of_logits(target, draft, temperature, top_k, top_p)
        sums.append(a.sum().item())
        counts.append(int(mask.sum()))
    return sums, counts


def tau_predicted(alphas: list[float]) -> dict[int, float]:
    """Expected tokens per target pass for chain length γ: 1 + Σ_{k≤γ} Π_{j≤k} α_j."""
    out, run, prod = {}, 1.0, 1.0
    for gamma, a in enumerate(alphas, start=1):
        prod *= a
        run += prod
        out[gamma] = run
    return out
