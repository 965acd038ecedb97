"""Fast tier: every family builds, trains, saves/loads, and drafts exactly what training computes."""
from __future__ import annotations

import pytest
import torch

from heads import HEADS, build_head
from heads.checkpoint import load_head, save_head
from heads.losses import head_loss

FAMILIES = sorted(HEADS)
EAGLE31 = {"fc_norm": True, "norm_output": True}  # EAGLE 3.1's norms change fuse, the fed-back state and logits
VARIANTS = [pytest.param(name, {}, id=name) for name in FAMILIES] + [pytest.param("eagle3", EAGLE31, id="eagle3.1")]


def make_head(name, target, **hp):
    head = build_head(name, target.dims, **hp)
    head.attach_target(target)
    head.init_from_target()
    return head


def batch(target, B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.dims.vocab_size, (B, T), generator=g)
    return ids


@pytest.mark.parametrize("name", FAMILIES)
def test_shapes_and_no_target_params(name, tiny_target):
    head = make_head(name, tiny_target, num_steps=3)
    ids = batch(tiny_target)
    feats = tiny_target.features(ids, layers=head.feature_layers)
    out = head(feats)
    assert len(out.logits) == 3
    for logits in out.logits:
        assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()
    target_params = {id(p) for p in tiny_target.model.parameters()}
    assert not any(id(p) in target_params for p in head.parameters())
    assert not any(k.startswith(("embed_tokens", "model.")) for k in head.state_dict())


@pytest.mark.parametrize("name", FAMILIES)
def test_overfits_one_batch(name, tiny_target):
    head = make_head(name, tiny_target, num_steps=2)
    feats = tiny_target.features(batch(tiny_target), layers=head.feature_layers)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):  # KL, not cross-entropy: it can reach 0, so "falls" means the head really fits
        loss, stats = head_loss(head, head(feats), feats, kind="kl")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name,hp", VARIANTS)
def test_save_load_identical(name, hp, tiny_target, tmp_path):
    head = make_head(name, tiny_target, num_steps=2, **hp)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.05)
    save_head(head, tmp_path / "head", tiny_target.identity())
    loaded, config = load_head(tmp_path / "head")
    loaded.attach_target(tiny_target)
    feats = tiny_target.features(batch(tiny_target), layers=head.feature_layers)
    for a, b in zip(head(feats).logits, loaded(feats).logits):
        torch.testing.assert_close(a, b)
    assert config["family"] == name


@pytest.mark.parametrize("name,hp", VARIANTS)
def test_drafting_matches_training(name, hp, tiny_target):
    """commit/step on a cache reproduce training's step-k logits at an anchor, in several commits."""
    K = 3
    head = make_head(name, tiny_target, num_steps=K, **hp)
    for p in head.parameters():  # a non-trivial head: zero-initialised parts would hide alignment bugs
        torch.nn.init.normal_(p, std=0.1)
    if name == "eagle3":
        head.set_vocab_map(torch.arange(tiny_target.dims.vocab_size).flip(0).float())
    T = 20
    ids = batch(tiny_target, B=1, T=T)
    feats = tiny_target.features(ids, layers=head.feature_layers)
    train_logits = [head.to_target_vocab(l) for l in head(feats).logits]
    cache = head.new_cache(64, "cpu", torch.float32)
    start = 0
    for anchor in (6, 9, 10, 14):  # commit in uneven chunks, drafting (and discarding) after each
        hidden = {k: v[:, start : anchor + 1] for k, v in feats.hidden.items()}
        logits, state = head.commit(cache, hidden, ids[:, start + 1 : anchor + 2], start)
        torch.testing.assert_close(logits[0], train_logits[0][0, anchor], atol=1e-4, rtol=1e-4)
        for k in range(2, K + 1):
            logits, state = head.step(cache, state, ids[0, anchor + k : anchor + k + 1], k)
            torch.testing.assert_close(logits[0], train_logits[k - 1][0, anchor], atol=1e-4, rtol=1e-4)
        start = anchor + 1


@pytest.mark.parametrize("name,hp", [("eagle", {}), ("eagle3", {}), pytest.param("eagle3", EAGLE31, id="eagle3.1")])
def test_step_tree_matches_chain_step(name, hp, tiny_target):
    """A tree level drafted at once (with distractor siblings and their own subtrees) gives the chain's logits
    on the path that follows the real tokens."""
    head = make_head(name, tiny_target, num_steps=3, **hp)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ids = batch(tiny_target, B=1, T=16)
    feats = tiny_target.features(ids, layers=head.feature_layers)
    anchor, depth = 9, 3
    hidden = {k: v[:, : anchor + 1] for k, v in feats.hidden.items()}

    cache = head.new_cache(64, "cpu", torch.float32)
    _, state = head.commit(cache, hidden, ids[:, 1 : anchor + 2], 0)
    chain = []
    for k in range(2, depth + 2):
        logits, state = head.step(cache, state, ids[0, anchor + k : anchor + k + 1], k)
        chain.append(logits[0])

    cache = head.new_cache(64, "cpu", torch.float32)
    _, (h0, _) = head.commit(cache, hidden, ids[:, 1 : anchor + 2], 0)
    # each level: [distractor, path node]; level d's nodes are children of level d-1's path node (index 1)
    slot, ancestors, parent_h = anchor + 1, [], h0.expand(1, 2, -1)
    for d in range(1, depth + 1):
        tokens = torch.stack([(ids[0, anchor + 1 + d] + 1) % tiny_target.dims.vocab_size, ids[0, anchor + 1 + d]])
        slots = torch.tensor([slot, slot + 1])
        bias = torch.full((2, slot + 2), float("-inf"))
        bias[:, : anchor + 1] = 0
        bias[:, ancestors] = 0
        bias[0, slot], bias[1, slot + 1] = 0, 0
        positions = torch.full((2,), anchor + d)
        logits, out = head.step_tree(cache, parent_h, tokens[None], positions, slots, bias)
        torch.testing.assert_close(logits[1], chain[d - 1], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(logits[0], logits[1])  # the distractor really is a different branch
        ancestors.append(slot + 1)
        parent_h = out[:, 1:2].expand(1, 2, -1)
        slot += 2


def test_eagle31_norms_are_in_the_forward_and_saved(tiny_target, tmp_path):
    """fc_norm and norm_output change what the head computes (a head that ignored them would equal plain EAGLE-3
    with the same shared weights) and travel in config.json."""
    torch.manual_seed(0)
    plain = make_head("eagle3", tiny_target, num_steps=2)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.1)
    feats = tiny_target.features(batch(tiny_target), layers=plain.feature_layers)
    for hp in ({"fc_norm": True}, {"norm_output": True}):
        variant = make_head("eagle3", tiny_target, num_steps=2, **hp)
        variant.load_state_dict(plain.state_dict(), strict=False)
        assert not torch.allclose(variant(feats).logits[1], plain(feats).logits[1])
        save_head(variant, tmp_path / str(hp), tiny_target.identity())
        saved = load_head(tmp_path / str(hp))[1]["hparams"]
        assert {k: saved[k] for k in hp} == hp
