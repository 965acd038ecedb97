"""The decode loop is exact: greedy speculative decoding emits the target's own greedy tokens, for every head
family, chain and tree, whether the head is mostly wrong (perturbed) or mostly right (oracle); sampling runs keep
consistent statistics."""
from __future__ import annotations

import pytest
import torch

from heads import HEADS
from serve.generate import Decoder, Sampling, generate
from serve.tree import MEDUSA_TREE, DynamicTree, StaticTree
from tests.serve.conftest import NoisyTargetHead, OracleHead, assert_same_greedy, hf_greedy, perturbed_head, runner_model

FAMILIES = sorted(HEADS)
pytestmark = pytest.mark.usefixtures("one_thread")


def settings(family: str, depth: int = 3, full: bool = True) -> list[dict]:
    """Chain γ = depth (and γ = 1); a static tree for Medusa, dynamic trees for EAGLE heads."""
    out = [{"gamma": depth}] + ([{"gamma": 1}] if full else [])
    if family == "medusa":
        out.append({"tree": StaticTree([p for p in MEDUSA_TREE if len(p) <= depth], "cpu")})
    if family in ("eagle", "eagle3"):
        out.append({"tree": DynamicTree(depth=depth, top_k=3, total_tokens=10)})
        if full:
            out.append({"tree": DynamicTree(depth=depth + 1, top_k=2, total_tokens=6)})
    return out


def check_family(family, target, prompts, n, min_oracle_tau, full=True):
    model = runner_model(target)
    head = perturbed_head(family, target, model)
    for prompt in prompts:
        ref, gaps = hf_greedy(target.model, prompt, n)
        for kw in settings(family, full=full):
            for h in (head, OracleHead(head, prompt.tolist() + ref)):
                out, stats = generate(Decoder(model, h, **kw), prompt, n)
                assert_same_greedy(out, ref, gaps)
                if isinstance(h, OracleHead) and kw.get("gamma", 2) > 1:
                    # the oracle really was accepted, several tokens a pass: the test exercised multi-token accepts
                    assert stats.summary()["tau_measured"] > min_oracle_tau, (kw, stats.summary())


def test_vanilla_equals_target(chaotic_target):
    model = runner_model(chaotic_target)
    prompt = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(0))
    ref, gaps = hf_greedy(chaotic_target.model, prompt, 40)
    out, stats = generate(Decoder(model), prompt, 40)
    assert_same_greedy(out, ref, gaps)
    assert stats.target_passes == 39 and stats.summary()["tau_measured"] == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_target(family, chaotic_target):
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(9))
    check_family(family, chaotic_target, [prompt], 32, min_oracle_tau=1.5, full=False)


@pytest.mark.shared
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_target_stories(family, stories_target):
    tok = stories_target.tokenizer
    prompts = [torch.tensor(tok(p).input_ids) for p in ("Once upon a time", "Tom and Lily went to the park. They")]
    check_family(family, stories_target, prompts, 48, min_oracle_tau=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_target_smollm2(family, smollm2_target):
    target = smollm2_target
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    text = target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor(target.tokenizer(text, add_special_tokens=False).input_ids)
    model = runner_model(target)
    ref, gaps = hf_greedy(target.model, prompt, 24)
    head = perturbed_head(family, target, model, std=0.002)
    kw = settings(family)[-1]  # the tree where the family has one, else the longest chain
    for h in (head, OracleHead(head, prompt.tolist() + ref)):
        out, _ = generate(Decoder(model, h, **kw), prompt, 24)
        assert_same_greedy(out, ref, gaps)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_sampling_stats_consistent(family, temperature, top_k, top_p, chaotic_target):
    model = runner_model(chaotic_target)
    head = perturbed_head(family, chaotic_target, model)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    for kw in settings(family, full=False):
        dec = Decoder(model, head, Sampling(temperature, top_k, top_p), seed=5, **kw)
        out, stats = generate(dec, prompt, 24)
        s = stats.summary()
        assert len(out) == 24 and all(0 <= t < chaotic_target.dims.vocab_size for t in out)
        assert sum(s["accept_length_hist"]) == s["target_passes"]
        assert sum(a * c for a, c in enumerate(s["accept_length_hist"])) + s["target_passes"] == stats.emitted
        assert 1 + stats.emitted >= len(out) > stats.emitted - len(s["accept_length_hist"])
        assert s["reached_per_position"][0] == s["target_passes"]
        assert all(a <= r for a, r in zip(s["accepted_per_position"], s["reached_per_position"]))
        assert all(r2 <= a1 for r2, a1 in zip(s["reached_per_position"][1:], s["accepted_per_position"]))
        # α per position is checked against how often drafts are kept in test_sampled_acceptance_matches_alpha
        again, _ = generate(Decoder(model, head, Sampling(temperature, top_k, top_p), seed=5, **kw), prompt, 24)
        assert again == out  # seeded: reproducible


def test_gamma_beyond_head_steps_is_refused(chaotic_target):
    model = runner_model(chaotic_target)
    head = perturbed_head("medusa", chaotic_target, model, num_steps=2)
    with pytest.raises(ValueError, match="exceeds"):
        Decoder(model, head, gamma=3)


@pytest.mark.slow  # ~3 HF forwards per round for the noisy drafts
def test_sampled_acceptance_matches_alpha(chaotic_target, family="eagle"):
    """Under sampling, how often position k is kept must match Σ min(p_k, q_k) at the same positions (within
    sampling error). This holds only if verify receives the very q each draft was drawn from and the right p:
    a misaligned q or p would still give exact greedy output but break this. (The drafts come from the wrapper,
    so one family covers the loop's bookkeeping.)"""
    model = runner_model(chaotic_target)
    real = perturbed_head(family, chaotic_target, model)
    total = None
    for seed in range(3):
        prompt = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(seed))
        head = NoisyTargetHead(real, chaotic_target.model, prompt.tolist(), seed=seed)
        _, stats = generate(Decoder(model, head, Sampling(1.0, 8, 1.0), gamma=3, seed=seed), prompt, 100)
        if total is None:
            total = stats
        else:
            total.merge(stats)
    s = total.summary()
    for rate, alpha, n in zip(s["accept_rate_per_position"], s["alpha_per_position"], s["reached_per_position"]):
        if n < 30:
            continue
        sigma = max(alpha * (1 - alpha), 0.02) ** 0.5 / n ** 0.5
        assert abs(rate - alpha) < 4 * sigma, (s["accept_rate_per_position"], s["alpha_per_position"], n)
    assert s["reached_per_position"][2] >= 30 and 0.2 < s["alpha_per_position"][0] < 0.95  # not a trivial case
