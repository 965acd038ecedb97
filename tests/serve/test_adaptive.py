"""Adaptive γ (serve/adaptive.py): it switches speculation off when the request's acceptance stops paying and on
again when it pays, and the decode loop stays exact through every switch (greedy equality, and a χ² test that the
sampled tokens follow the target)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from heads import HEADS
from heads.sampling import probs_from_logits
from serve import adaptive as adaptive_module
from serve import generate as generate_module
from serve.adaptive import Adaptive
from serve.generate import Decoder, Sampling, generate
from serve.setting import Costs
from tests.serve.conftest import OracleHead, assert_same_greedy, hf_greedy, perturbed_head, runner_model

pytestmark = pytest.mark.usefixtures("one_thread")

R = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6}  # r(n): a target pass over n tokens ÷ one


def flip_prone(**kw) -> Adaptive:
    """Speculation pays iff the running α at position 1 exceeds ~0.4, and the estimate follows the last rounds:
    at the chaotic target's α ≈ 0.4 (T = 1) it switches often."""
    return Adaptive([0.45, 0.45, 0.45], Costs(R, 0.2),
                    **{"prior_weight": 0.5, "decay": 0.5, "probe_every": 2, "probe_max": 2, **kw})


def test_switches_off_probes_and_returns():
    ad = Adaptive([0.9, 0.9, 0.9], Costs(R, 0.1), prior_weight=2.0, probe_every=4)
    assert ad.choose() == 3  # the prior alone: cheap drafts, good α
    for _ in range(6):  # a stretch of text where nothing is accepted
        ad.observe(1, [0.0])
    assert ad.speedups()[1] < 1.0
    picks = [ad.choose() for _ in range(20)]
    assert picks == [0, 0, 0, 1] + [0] * 7 + [1] + [0] * 8  # off; a failed probe doubles the wait for the next
    for _ in range(20):  # the text turns easy: everything accepted
        ad.observe(3, [1.0, 1.0, 1.0])
    assert ad.choose() == 3 and ad.probe_gap == 4  # drafting again: the next time off, probes start at 4 again
    ad.reset()  # a new request starts from the prior again
    assert ad.estimate() == pytest.approx([0.9, 0.9, 0.9])


def test_a_compile_inside_a_timed_round_does_not_keep_speculation_on():
    """The prior predicts γ = 1 pays 1.04x (τ 1.35 over r(2) + c = 1.3), but a drafted round really costs 1.45 plain
    rounds (0.93x). The first timed plain round is a 2 s compile: counted, it would make every drafted round look
    nearly free in its units, and speculation would never go off nor time a plain round again."""
    ad = Adaptive([0.35], Costs({1: 1.0, 2: 1.2}, 0.1), prior_weight=2.0, pass_s=0.01)
    seconds = {0: 0.01, 1: 0.0145}
    ad.observe_time(0, 2.0)  # the warm-up compiles the plain pass
    picks = []
    for _ in range(40):
        i = ad.choose()
        picks.append(i)
        if i:
            ad.observe(1, [0.35])
        ad.observe_time(i, seconds[i])
    assert picks[:2] == [0, 0] and 1 in picks[2:5], picks  # calibrated, then the prior's γ = 1 is tried
    assert ad.round_s == pytest.approx(0.01) and ad.speedups()[1] < 1.0
    assert picks[-16:].count(1) <= 1, picks  # then off, probing at most once per probe_every rounds
    for _ in range(20):  # a machine that stays 4x slower is not an outlier for long
        ad.observe_time(0, 0.04)
    assert ad.round_s > 0.03


def test_plain_rounds_do_not_rescore(monkeypatch):
    """While speculation is off a round is plain and its time changes no score (costs and excesses are counted in
    plain rounds), so only a drafted round's outcome re-runs the model: with trees that is ~20 predictions."""
    calls = []
    real = adaptive_module.predict
    monkeypatch.setattr(adaptive_module, "predict", lambda *a, **k: calls.append(1) or real(*a, **k))
    ad = Adaptive([0.05, 0.02], Costs({1: 1.0, 2: 1.2, 3: 1.4}, 0.2), pass_s=0.01, probe_every=100)
    built = len(calls)  # __post_init__'s cost of each setting
    picks = []
    for _ in range(30):
        picks.append(ad.choose())
        ad.observe_time(picks[-1], 0.01 + 0.001 * len(picks))  # the machine slows down: round_s follows
    assert picks == [0] * 30 and ad.round_s > 0.015
    assert len(calls) - built == 2  # one scoring of the two chains, kept over 28 plain rounds
    ad.observe(1, [1.0])  # a drafted round's outcome does re-score
    ad.choose()
    assert len(calls) - built == 4


def test_refuses_trees_and_missing_heads(chaotic_target):
    from serve.tree import DynamicTree

    model = runner_model(chaotic_target)
    head = perturbed_head("eagle", chaotic_target, model)
    with pytest.raises(ValueError, match="chain"):
        Decoder(model, head, tree=DynamicTree(3, 2, 4), adaptive=flip_prone())
    with pytest.raises(ValueError, match="draft head"):
        Decoder(model, None, adaptive=flip_prone())
    with pytest.raises(ValueError, match="exceeds"):
        Decoder(model, perturbed_head("medusa", chaotic_target, model, num_steps=2), adaptive=flip_prone())


@pytest.mark.parametrize("family", sorted(HEADS))
def test_adaptive_greedy_equals_target(family, chaotic_target):
    model = runner_model(chaotic_target)
    head = perturbed_head(family, chaotic_target, model)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(9))
    ref, gaps = hf_greedy(chaotic_target.model, prompt, 40)
    weak = Adaptive([0.6, 0.5, 0.4], Costs(R, 0.1), prior_weight=1.0, probe_every=3)
    out, stats = generate(Decoder(model, head, adaptive=weak), prompt, 40)
    assert_same_greedy(out, ref, gaps)
    rounds = stats.summary()["rounds_per_draft_depth"]
    assert rounds[0] > 0 and sum(rounds[1:]) > 0, rounds  # it drafted, switched off, and probed
    oracle = OracleHead(head, prompt.tolist() + ref)
    out, stats = generate(Decoder(model, oracle, adaptive=weak), prompt, 40)
    assert_same_greedy(out, ref, gaps)
    s = stats.summary()
    assert s["tau_measured"] > 1.3 and s["rounds_per_draft_depth"][0] <= 2, s  # a strong head stays on


def pit_pvalue(target, prompts, outputs, seed=0, bins=10) -> float:
    """Randomised probability integral transform of every emitted token under the target's own T = 1
    distribution given the emitted prefix, tokens ordered most probable first: iid Uniform(0, 1) iff the tokens
    follow the target (a draw from a worse guess lands further down the order, so the test has power). χ² on
    bins."""
    g = torch.Generator().manual_seed(seed)
    values = []
    for prompt, out in zip(prompts, outputs):
        seq = torch.cat([prompt, torch.tensor(out)])
        with torch.no_grad():
            logits = target.model(seq[None]).logits[0, len(prompt) - 1 : -1].double()
        target_probs = probs_from_logits(logits, 1.0, 0, 1.0)  # [n, V]
        y = torch.tensor(out)
        order = torch.sort(target_probs, dim=-1, descending=True, stable=True).indices  # [n, V]
        sorted_probs = target_probs.gather(1, order)
        rank = order.argsort(dim=-1).gather(1, y[:, None])  # [n, 1]: y's place in that order
        below = (sorted_probs.cumsum(-1) - sorted_probs).gather(1, rank)[:, 0]
        values.append(below + torch.rand(len(out), generator=g, dtype=torch.float64) * target_probs[range(len(out)), y])
    u = torch.cat(values)
    counts = torch.histc(u.float(), bins=bins, min=0.0, max=1.0)
    return float(chisquare(counts.numpy()).pvalue)


def sampled_runs(model, head, prompts, n=150):
    outs, total = [], None
    for i, prompt in enumerate(prompts):
        dec = Decoder(model, head, Sampling(1.0), seed=i, adaptive=flip_prone())
        out, stats = generate(dec, prompt, n)
        outs.append(out)
        total = stats if total is None else (total.merge(stats) or total)
    return outs, total.summary()


def test_adaptive_sampling_follows_target(chaotic_target, monkeypatch):
    """Tokens sampled at T = 1 through many on/off switches follow the target; the same check rejects a loop
    that keeps every draft (tokens from q, not p), so it can fail."""
    model = runner_model(chaotic_target)
    head = perturbed_head("eagle", chaotic_target, model)
    prompts = [torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    outs, s = sampled_runs(model, head, prompts)
    rounds = s["rounds_per_draft_depth"]
    assert rounds[0] > 30 and sum(rounds[1:]) > 30 and sum(s["accepted_per_position"]) > 20, s
    assert pit_pvalue(chaotic_target, prompts, outs) > 1e-3

    def keep_all(draft_tokens, draft_probs, target_probs, generator):
        n = torch.full((1,), draft_tokens.shape[1])
        return n, target_probs[0, -1].argmax(-1, keepdim=True)

    monkeypatch.setattr(generate_module, "verify_chain_batched", keep_all)
    wrong, _ = sampled_runs(model, head, prompts)
    assert pit_pvalue(chaotic_target, prompts, wrong) < 1e-3
