"""α and τ against brute force on small distributions; a head that copies the target is accepted always."""
from __future__ import annotations

import itertools

import pytest
import torch

from heads.base import DraftHead, HeadOutput
from heads.losses import alpha, alpha_of_logits, alpha_sums, tau_predicted
from heads.sampling import probs_from_logits


def brute_processed(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The sampler's distribution, written out element by element (no tensors)."""
    V = len(logits)
    if temperature == 0:
        best = max(range(V), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(V)]
    z = [x / temperature for x in logits]
    keep = set(range(V))
    if top_k:
        keep = set(sorted(range(V), key=lambda i: -z[i])[:top_k])
    weights = {i: torch.tensor(z[i]).exp().item() for i in keep}
    if top_p < 1.0:
        total = sum(weights.values())
        kept, mass = set(), 0.0
        for i in sorted(weights, key=lambda i: -weights[i]):
            if mass >= top_p:
                break
            kept.add(i)
            mass += weights[i] / total
        weights = {i: w for i, w in weights.items() if i in kept}
    total = sum(weights.values())
    return [weights.get(i, 0.0) / total for i in range(V)]


def brute_accept_probability(p: list[float], q: list[float]) -> float:
    """Speculative sampling: draft x ~ q, accept with min(1, p(x)/q(x)); summed over every x."""
    return sum(qx * min(1.0, px / qx) for px, qx in zip(p, q) if qx > 0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8),
                                                      (1.0, 4, 0.6)])
def test_alpha_matches_brute_force(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        target_logits, draft_logits = torch.randn(2, 6, generator=g) * 2
        p = brute_processed(target_logits.tolist(), temperature, top_k, top_p)
        q = brute_processed(draft_logits.tolist(), temperature, top_k, top_p)
        got = alpha(probs_from_logits(target_logits, temperature, top_k, top_p),
                    probs_from_logits(draft_logits, temperature, top_k, top_p))
        assert got.item() == pytest.approx(brute_accept_probability(p, q), abs=1e-5)
        direct = alpha_of_logits(target_logits[None], draft_logits[None], temperature, top_k, top_p)
        assert direct.item() == pytest.approx(brute_accept_probability(p, q), abs=1e-5)


def test_greedy_alpha_of_logits_with_ties_and_a_reduced_draft_vocabulary():
    """T = 0 compares argmaxes directly: the same 0/1 as the one-hots' Σ min(p, q), ties going to the first index
    (integer logits tie often) and a draft scattered into the target vocabulary (-inf outside it) included."""
    g = torch.Generator().manual_seed(2)
    target = torch.randint(0, 3, (500, 7), generator=g).float()
    draft = torch.randint(0, 3, (500, 7), generator=g).float()
    draft[:, [1, 4]] = float("-inf")
    one_hots = alpha(probs_from_logits(target, 0.0), probs_from_logits(draft, 0.0))
    assert torch.equal(alpha_of_logits(target, draft, 0.0), one_hots)
    assert 0 < one_hots.sum() < len(one_hots)  # both outcomes occur


def test_tau_matches_enumeration():
    """τ(γ): expected tokens per target pass when draft k is accepted with probability α_k given all before were."""
    alphas = [0.8, 0.6, 0.5, 0.3]
    for gamma in range(1, len(alphas) + 1):
        expected = 0.0
        for outcome in itertools.product([True, False], repeat=gamma):  # draft k accepted or not, independently
            prob = 1.0
            for k, ok in enumerate(outcome):
                prob *= alphas[k] if ok else 1 - alphas[k]
            accepted = next((k for k, ok in enumerate(outcome) if not ok), gamma)  # the chain stops at a rejection
            expected += prob * (accepted + 1)  # accepted drafts + the target's own token
        assert tau_predicted(alphas)[gamma] == pytest.approx(expected)


class CopyHead(DraftHead):
    """Step k at anchor t emits the target's own logits for t+k: the perfect draft."""

    family = "copy"

    def forward(self, feats, num_steps=None):
        T = feats.target_logits.shape[1]
        out = []
        for k in range(1, self.num_steps + 1):
            shifted = torch.cat([feats.target_logits[:, k:], feats.target_logits[:, -1:].expand(-1, k, -1)], dim=1)
            out.append(shifted[:, :T])
        return HeadOutput(out)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_copying_head_has_alpha_one(tiny_target, temperature, top_k, top_p):
    ids = torch.randint(0, tiny_target.dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :3] = False
    feats = tiny_target.features(ids, mask)
    head = CopyHead(tiny_target.dims, num_steps=3)
    sums, counts = alpha_sums(head, head(feats), feats, temperature, top_k, top_p)
    assert counts == [int(mask[:, k:].sum()) for k in (1, 2, 3)]
    for s, c in zip(sums, counts):
        assert s / c == pytest.approx(1.0, abs=1e-5)


def test_wrong_head_is_not_accepted(tiny_target):
    """The opposite check: a head that copies the target one position late is (almost) never accepted at T=0."""
    ids = torch.randint(0, tiny_target.dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    feats = tiny_target.features(ids)
    head = CopyHead(tiny_target.dims, num_steps=2)
    late = HeadOutput([torch.roll(x, 1, dims=1) for x in head(feats).logits])
    sums, counts = alpha_sums(head, late, feats, 0.0)
    assert sums[0] / counts[0] < 0.3


def random_head(name, target):
    """A 3-step head with random weights (EAGLE-3: a random 100-token draft vocabulary): a trained head's
    logits are far from uniform, and so are these."""
    from heads import build_head

    head = build_head(name, target.dims, num_steps=3, **({"draft_vocab_size": 100} if name == "eagle3" else {}))
    head.attach_target(target)
    if name == "eagle3":
        head.set_vocab_map(torch.rand(target.dims.vocab_size, generator=torch.Generator().manual_seed(0)))
    head.init_from_target()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return head


@pytest.mark.parametrize("name", ["eagle3", "medusa"])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_training_alpha_equals_alpha_sums(name, temperature, tiny_target):
    """head_loss' fast α (no [N, V] tensors) is the same number alpha_sums computes over the target vocabulary."""
    from heads.losses import head_loss

    head = random_head(name, tiny_target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny_target.dims.vocab_size, (3, 40), generator=g)
    feats = tiny_target.features(ids, torch.rand(3, 40, generator=g) > 0.3, layers=head.feature_layers)
    out = head(feats)
    _, stats = head_loss(head, out, feats, temperature=temperature)
    sums, counts = alpha_sums(head, out, feats, temperature)
    for k in (1, 2, 3):
        assert stats[f"alpha@{k}"].item() == pytest.approx(sums[k - 1] / counts[k - 1], abs=1e-5)
        assert int(stats[f"count@{k}"]) == counts[k - 1]


@pytest.mark.parametrize("name,kind", [("medusa", "soft_ce"), ("eagle", "soft_ce"), ("eagle", "kl"),
                                       ("eagle3", "soft_ce"), ("mtp", "tv"), ("eagle3", "lk")])
def test_scored_rows_loss_equals_full_vocab_loss(name, kind, tiny_target):
    """head_loss reads logits out only at scored rows and builds the target's soft labels once; the loss and every
    gradient must be those of the plain full-vocabulary computation, or the speed-up changed training."""
    from heads.losses import full_vocab_loss, head_loss

    head = random_head(name, tiny_target)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny_target.dims.vocab_size, (3, 40), generator=g)
    mask = torch.rand(3, 40, generator=g) > 0.4
    mask[:, :6] = False  # a prompt, and a row that is all padding: rows no step scores
    mask[2] = False
    feats = tiny_target.features(ids, mask, layers=head.feature_layers)

    def loss_and_grads(fn):
        head.zero_grad()
        loss = fn(head, head(feats), feats, kind=kind, step_decay=0.8)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads(head_loss)
    ref_loss, ref_grads = loss_and_grads(full_vocab_loss)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    assert any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("name", ["eagle3", "eagle"])
def test_packed_target_logits_score_as_dense(name, tiny_target):
    """The feature cache's path keeps the target's logits only at scored rows ([N, V], loss_mask order): the loss,
    the gradients, α and the acceptance grid must be those of the dense [B, T, V] batch."""
    from dataclasses import replace

    from heads.losses import head_loss
    from train.acceptance import acceptance_grid

    head = random_head(name, tiny_target)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, tiny_target.dims.vocab_size, (3, 30), generator=g)
    mask = torch.rand(3, 30, generator=g) > 0.4
    mask[:, :4] = False
    dense = tiny_target.features(ids, mask, layers=head.feature_layers)
    packed = replace(dense, target_logits=dense.target_logits[mask])
    for k in (0, 1, 3):
        torch.testing.assert_close(packed.scored_target_logits(k), dense.scored_target_logits(k))

    def run(feats):
        head.zero_grad()
        out = head(feats)
        loss, stats = head_loss(head, out, feats, temperature=1.0)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])
        return loss.detach(), stats, grads, alpha_sums(head, out, feats, 0.7), acceptance_grid(head, out, feats, 1.0, 0, 1.0)

    (loss, stats, grads, sums, grid), ref = run(packed), run(dense)
    assert loss.item() == pytest.approx(ref[0].item(), rel=1e-6)
    assert stats["alpha@2"].item() == pytest.approx(ref[1]["alpha@2"].item(), abs=1e-6)
    torch.testing.assert_close(grads, ref[2])
    # (Σα per step, token count per step): pytest >= 9.2 refuses approx on nested tuples, so compare each part
    assert sums[0] == pytest.approx(ref[3][0]) and sums[1] == ref[3][1] and grid.sum() > 0
    torch.testing.assert_close(grid, ref[4])


@pytest.mark.parametrize("name", ["eagle3", "mtp"])
def test_draft_column_target_logits_give_the_same_loss_without_alpha(name, tiny_target):
    """Training steps that log no α compute the target's logits only at the loss's columns (EAGLE-3's draft
    vocabulary, MTP's frequent + sampled tokens): the loss and gradients must be those of the full-vocabulary
    logits, α is left out (it needs the full vocabulary), and logits for other columns are refused."""
    from heads import build_head
    from heads.losses import head_loss

    V = tiny_target.dims.vocab_size
    if name == "eagle3":
        head = random_head("eagle3", tiny_target)
    else:
        head = build_head("mtp", tiny_target.dims, num_steps=3, loss_vocab_size=V // 4, loss_vocab_sampled=V // 8)
        head.attach_target(tiny_target)
        head.set_vocab_map(torch.rand(V, generator=torch.Generator().manual_seed(3)))
        head.resample_loss_vocab(5)
    head.train()
    cols = head.from_target_vocab(torch.arange(V))
    assert cols.numel() < V
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, V, (3, 30), generator=g)
    mask = torch.rand(3, 30, generator=g) > 0.4
    full = tiny_target.features(ids, mask, layers=head.feature_layers)
    narrow = tiny_target.features(ids, mask, layers=head.feature_layers, columns=cols)
    assert narrow.target_logits.shape[-1] == cols.numel()

    def run(feats):
        head.zero_grad()
        loss, stats = head_loss(head, head(feats), feats, step_decay=0.8)
        loss.backward()
        return loss.detach(), stats, [p.grad.clone() for p in head.parameters() if p.grad is not None]

    (loss, stats, grads), (ref, ref_stats, ref_grads) = run(narrow), run(full)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert "alpha@1" in ref_stats and not any(k.startswith("alpha@") for k in stats)
    assert {k for k in stats if k.startswith(("loss@", "count@"))} == \
        {k for k in ref_stats if k.startswith(("loss@", "count@"))}
    other = tiny_target.features(ids, mask, layers=head.feature_layers, columns=cols.flip(0))
    with pytest.raises(ValueError, match="other columns than the head's draft vocabulary"):
        head_loss(head, head(other), other)


@pytest.mark.parametrize("family", ["eagle", "mtp", "medusa"])
def test_loss_vocab_trains_on_frequent_tokens_and_drafts_all(tiny_target, family):
    """loss_vocab_size (EAGLE-1, MTP, Medusa): in training, the loss is the full-vocabulary head's soft CE restricted
    to the most frequent training tokens and renormalised there (brute force below, with the gradients); in eval mode
    (held-out α, drafting, export) the head is the full-vocabulary head with the same weights."""
    from heads import build_head
    from heads.losses import head_loss, shift_pair

    V = tiny_target.dims.vocab_size
    full = random_head(family, tiny_target)
    small = build_head(family, tiny_target.dims, num_steps=3, loss_vocab_size=V // 4)
    small.attach_target(tiny_target)
    counts = torch.rand(V, generator=torch.Generator().manual_seed(3))
    small.set_vocab_map(counts)
    small.load_state_dict(full.state_dict())
    keep = counts.argsort(descending=True)[: V // 4].sort().values
    assert torch.equal(small.loss_vocab, keep)

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (3, 30), generator=g)
    mask = torch.rand(3, 30, generator=g) > 0.4
    mask[:, :4] = False
    feats = tiny_target.features(ids, mask, layers=small.feature_layers)

    def brute(head):  # every position's full logits, then the frequent columns, then the mask
        out = head(feats)
        total = sum(out.aux.values(), torch.tensor(0.0))  # EAGLE-1's feature loss; MTP and Medusa have none
        for k, logits in enumerate(out.logits, start=1):
            draft, target, m = shift_pair(logits[..., keep], feats.target_logits[..., keep], mask, k)
            total = total + 0.8 ** (k - 1) * -(target[m].softmax(-1) * draft[m].log_softmax(-1)).sum(-1).mean()
        return total

    small.train(), full.eval()
    loss, stats = head_loss(small, small(feats), feats, step_decay=0.8)
    ref = brute(full)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    loss.backward(), ref.backward()
    for (n, p), q in zip(small.named_parameters(), full.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    assert 0 < stats["alpha@1"] < 1

    small.eval()
    with torch.no_grad():
        for a, b in zip(small(feats).logits, full(feats).logits):
            assert a.shape[-1] == V
            torch.testing.assert_close(a, b)
        (small_sums, small_counts), (full_sums, full_counts) = (alpha_sums(h, h(feats), feats, 1.0) for h in (small, full))
        assert small_sums == pytest.approx(full_sums) and small_counts == full_counts


def test_loss_vocab_sampled_adds_fresh_other_tokens_each_step(tiny_target):
    """loss_vocab_sampled: each resample keeps every frequent token and adds that many distinct others, a different
    draw each step and the same for the same step (so every token is under the loss now and then, and a resume
    repeats the draws); the loss is the brute-force soft CE over exactly the drawn set, and eval mode still reads
    the full vocabulary."""
    from heads import build_head
    from heads.losses import head_loss, shift_pair

    V = tiny_target.dims.vocab_size
    head = build_head("mtp", tiny_target.dims, num_steps=2, loss_vocab_size=V // 4, loss_vocab_sampled=V // 8)
    head.attach_target(tiny_target)
    counts = torch.rand(V, generator=torch.Generator().manual_seed(3))
    head.set_vocab_map(counts)
    frequent = counts.argsort(descending=True)[: V // 4]
    draws = []
    for step in range(3):
        head.resample_loss_vocab(step)
        ids = head.loss_vocab.clone()
        assert ids.numel() == V // 4 + V // 8 and torch.equal(ids, ids.unique())  # sorted, no repeats
        assert torch.isin(frequent, ids).all()
        draws.append(ids[~torch.isin(ids, frequent)])
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    head.resample_loss_vocab(1)  # a function of the step: a resumed run draws the same
    assert torch.equal(head.loss_vocab[~torch.isin(head.loss_vocab, frequent)], draws[1])

    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (2, 24), generator=g)
    mask = torch.rand(2, 24, generator=g) > 0.3
    feats = tiny_target.features(tokens, mask, layers=head.feature_layers)
    head.train()
    loss, _ = head_loss(head, head(feats), feats)
    keep = head.loss_vocab
    head.eval()
    with torch.no_grad():
        full = head(feats).logits
        assert all(logits.shape[-1] == V for logits in full)
        ref = 0.0
        for k, logits in enumerate(full, start=1):
            draft, target, m = shift_pair(logits[..., keep], feats.target_logits[..., keep], mask, k)
            ref = ref + -(target[m].softmax(-1) * draft[m].log_softmax(-1)).sum(-1).mean()
    assert loss.item() == pytest.approx(float(ref), rel=1e-5)


@pytest.mark.parametrize("hp, match", [({"loss_vocab_sampled": 64}, "set head.hparams.loss_vocab_size"),
                                       ({"loss_vocab_size": 0}, ">= 1"),
                                       ({"loss_vocab_size": 64, "loss_vocab_sampled": -1}, ">= 0")])
def test_loss_vocab_bad_settings_get_one_line_errors(tiny_target, hp, match):
    from heads import build_head

    with pytest.raises(ValueError, match=match) as err:
        build_head("medusa", tiny_target.dims, num_steps=2, **hp)
    assert "\n" not in str(err.value)


def test_lk_alpha_is_tv_scaled_by_one_over_alpha_and_ce_on_a_point_mass():
    """-log α: its gradient is TV's divided by α (what lets a cold draft learn from an α objective), and with a
    one-hot target it is the cross-entropy of the target's token. A loss that dropped the log, or the 1/α, fails."""
    from heads.losses import distill_loss

    g = torch.Generator().manual_seed(0)
    target = torch.randn(6, 11, generator=g).mul(2).softmax(-1)
    draft = torch.randn(6, 11, generator=g, requires_grad=True)
    lk = distill_loss(draft, target, "lk_alpha")
    (grad_lk,) = torch.autograd.grad(lk.sum(), draft)
    tv = distill_loss(draft, target, "tv")
    (grad_tv,) = torch.autograd.grad(tv.sum(), draft)
    a = alpha(target, draft.softmax(-1)).detach()
    torch.testing.assert_close(lk, -a.log())
    torch.testing.assert_close(grad_lk, grad_tv / a[:, None])
    onehot = torch.nn.functional.one_hot(target.argmax(-1), 11).float()
    torch.testing.assert_close(distill_loss(draft, onehot, "lk_alpha"),
                               torch.nn.functional.cross_entropy(draft, target.argmax(-1), reduction="none"))


def test_lk_hybrid_leans_on_kl_when_alpha_is_low_and_on_tv_when_high():
    """λ = exp(-η α) with α detached: the gradient is λ ∇KL + (1 - λ) ∇TV and nothing flows through λ. A far
    draft (α ~ 0) gets KL's gradient, a near one mostly TV's; the loss is 0 where the draft is the target."""
    from heads.losses import distill_loss

    g = torch.Generator().manual_seed(1)
    target = torch.randn(4, 9, generator=g).softmax(-1)
    for draft0 in (torch.randn(4, 9, generator=g) * 8, target.log() + 0.3 * torch.randn(4, 9, generator=g)):
        draft = draft0.clone().requires_grad_(True)
        grads = {k: torch.autograd.grad(distill_loss(draft, target, k).sum(), draft)[0] for k in ("lk", "kl", "tv")}
        lam = torch.exp(-3.0 * alpha(target, draft.softmax(-1))).detach()[:, None]
        torch.testing.assert_close(grads["lk"], lam * grads["kl"] + (1 - lam) * grads["tv"])
    same = distill_loss(target.log(), target, "lk")
    torch.testing.assert_close(same, torch.zeros(4), atol=1e-6, rtol=0)


def test_unknown_loss_kind_is_one_line_naming_the_choices():
    from heads.errors import UserError
    from train.module import LossConfig

    with pytest.raises(UserError, match="head.loss.kind=lk2 .*soft_ce, kl, tv, lk, lk_alpha"):
        LossConfig(kind="lk2")
