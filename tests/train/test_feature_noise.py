"""head.loss.feature_noise: EAGLE-1's data noise on the tapped target states, scaled per dimension."""
from __future__ import annotations

import pytest
import torch

from heads import build_head
from train import UserError
from train.module import DraftModule, EvalConfig, LossConfig, OptimConfig, with_feature_noise


def test_noise_moves_each_tapped_state_by_the_asked_fraction_of_its_spread_and_never_the_final_one(tiny_target):
    L = tiny_target.dims.num_layers
    head = build_head("eagle3", tiny_target.dims, num_steps=2, draft_vocab_size=100)
    ids = torch.randint(0, tiny_target.dims.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    attn[1, 40:] = 0  # padding: not part of any dimension's spread
    feats = tiny_target.features(ids, attn.bool(), attn, layers=head.feature_layers)
    torch.manual_seed(0)
    noisy = with_feature_noise(feats, 0.1, L)
    assert torch.equal(noisy.hidden[L], feats.hidden[L]) and torch.equal(noisy.target_logits, feats.target_logits)
    tapped = [k for k in feats.hidden if k != L]
    assert tapped
    for k in tapped:
        real = attn.bool()
        delta, spread = (noisy.hidden[k] - feats.hidden[k])[real], feats.hidden[k][real].std(0)
        ratio = delta.std(0) / spread  # per dimension: ~0.1 over 232 tokens
        assert 0.08 < ratio.median() < 0.12 and (delta.abs() <= 0.1 * 3 ** 0.5 * spread + 1e-6).all()


def test_noise_on_a_head_that_reads_only_the_final_state_is_refused_in_one_line(tiny_target):
    head = build_head("medusa", tiny_target.dims, num_steps=2)
    with pytest.raises(UserError, match="head=medusa reads only the final state.*feature_noise=0"):
        DraftModule(head, tiny_target, LossConfig(feature_noise=0.1), OptimConfig(), EvalConfig())
    with pytest.raises(UserError, match="fraction in"):
        LossConfig(feature_noise=2.0)
