"""``head.loss.greedy_only``: step k of a head that never sees the tokens drafted before it trains only where those
k text tokens were the target's greedy choices. Checked against loops over the dense logits, on text where some
tokens are the target's argmax and the rest are not."""
from __future__ import annotations

import pytest
import torch

from heads.losses import distill_loss, greedy_context, head_loss


def partly_greedy_text(target, B=3, T=28, seed=0):
    """Random ids in which ~half the tokens are replaced, left to right, by the target's argmax at the position
    before (changing x_{t+1} never changes the logits at t, so each replacement stays greedy)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.dims.vocab_size, (B, T), generator=g)
    choose = torch.rand(B, T, generator=g) < 0.6
    for t in range(T - 1):
        logits = target.features(ids).target_logits[:, t]
        ids[:, t + 1] = torch.where(choose[:, t + 1], logits.argmax(-1), ids[:, t + 1])
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :4] = False  # a prompt: its tokens are given, never drafted, so no kept window may cross it
    mask[:, -1] = False  # the last position has no next token
    return ids, mask


def brute_force_keep(ids, logits, mask, k):
    """[N] for the rows in loss_mask order: position p >= k and x_{p-j+1} is the argmax at p-j for j = 1..k."""
    rows = []
    for b, p in mask.nonzero().tolist():
        rows.append(p >= k and all(bool(mask[b, p - j]) and int(ids[b, p - j + 1]) == int(logits[b, p - j].argmax())
                                   for j in range(1, k + 1)))
    return torch.tensor(rows)


def test_greedy_context_matches_brute_force_and_is_all_true_on_greedy_text(tiny_target):
    ids, mask = partly_greedy_text(tiny_target)
    feats = tiny_target.features(ids, mask)
    keep = greedy_context(feats, 4)
    for k in range(1, 5):
        expected = brute_force_keep(ids, feats.target_logits, mask, k)
        assert torch.equal(keep[k - 1], expected), k
    assert 0 < int(keep[0].sum()) < int(mask.sum())  # the text mixes both kinds of row: the check above can fail
    assert all(int(later.sum()) <= int(earlier.sum()) for earlier, later in zip(keep, keep[1:]))

    greedy = ids.clone()  # the target's own greedy continuation of the prompt: every window qualifies
    for t in range(4, greedy.shape[1] - 1):
        greedy[:, t + 1] = tiny_target.features(greedy).target_logits[:, t].argmax(-1)
    feats = tiny_target.features(greedy, mask)
    position = mask.nonzero()[:, 1]
    for k, kept in enumerate(greedy_context(feats, 4), start=1):
        assert torch.equal(kept, position - k >= 4), k  # windows inside the answer (position 4 on)


def test_greedy_only_loss_is_the_mean_over_kept_rows(tiny_target):
    """The loss (and so its gradient) is each step's soft CE averaged over exactly the kept rows, decayed per step;
    kept@k is the kept share of the rows step k would otherwise train."""
    from tests.heads.test_losses import random_head

    head = random_head("medusa", tiny_target)
    ids, mask = partly_greedy_text(tiny_target, seed=1)
    feats = tiny_target.features(ids, mask, layers=head.feature_layers)
    out = head(feats)
    loss, stats = head_loss(head, out, feats, step_decay=0.8, temperature=0.0, greedy_only=True)
    expected = 0.0
    position = mask.nonzero()[:, 1]
    for k in range(1, 4):
        keep = brute_force_keep(ids, feats.target_logits, mask, k)
        b, p = mask.nonzero()[keep].unbind(1)
        draft = out.logits[k - 1][b, p - k]
        step = distill_loss(draft, feats.target_logits[b, p].softmax(-1)).mean()
        expected += 0.8 ** (k - 1) * step
        assert stats[f"kept@{k}"].item() == pytest.approx(int(keep.sum()) / int((position >= k).sum()))
        assert int(stats[f"count@{k}"]) == int(keep.sum())
    assert loss.item() == pytest.approx(float(expected.detach()), rel=1e-5)
    plain, _ = head_loss(head, out, feats, step_decay=0.8, temperature=0.0)
    assert abs(plain.item() - loss.item()) > 1e-4  # the option changed what is trained
