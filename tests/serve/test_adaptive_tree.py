"""Adaptive trees (serve/adaptive.py with tree settings): each round picks plain decoding, a chain or a tree from
the running acceptance, and the loop stays exact through every switch (greedy equality, and the χ² test of
test_adaptive.py on sampled tokens). Also: gamma=auto's τ from acceptance.json's chain figures when recorded."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from serve import auto
from serve import generate as generate_module
from serve.adaptive import Adaptive
from serve.generate import Decoder, Sampling, generate
from serve.setting import Costs, Setting
from tests.serve.conftest import OracleHead, assert_same_greedy, hf_greedy, perturbed_head, runner_model
from tests.serve.test_adaptive import pit_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")

# cheap width, dear draft steps: at α ≈ 0.45 a small tree, γ = 1 and plain decoding are all close calls
R = {n: 1.0 + 0.03 * (n - 1) for n in (1, 2, 3, 4, 8, 12, 18, 25)}
DYNAMIC = [Setting.chain(0), Setting.chain(1), Setting.chain(2), Setting.dynamic_tree(2, 2, 3),
           Setting.dynamic_tree(3, 2, 6)]


def settings_for(family):
    if family == "medusa":  # γ 0..3 and Medusa-tree cuts of depth 2 and 3, as gamma=adaptive tree=static has them
        return auto.candidates("medusa", 3, [0.5] * 3, "static")
    return DYNAMIC


def flip_prone(family) -> Adaptive:
    return Adaptive([0.45] * 3, Costs(R, 0.3), prior_weight=0.5, decay=0.5, probe_every=2, probe_max=2,
                    settings=settings_for(family))


def kinds(dec) -> Counter:
    """Rounds per kind of setting in the decoder's last request: plain, chain, tree."""
    return Counter(dec.adaptive.settings[i].kind for i in dec.trace)


def test_tree_rounds_count_sibling_trials():
    ad = Adaptive([0.5, 0.5], Costs(R, 0.3), prior_weight=1.0, decay=1.0, settings=DYNAMIC)
    # root 0 has children 1, 2, 3; node 2 has children 4, 5; node 4 has child 6
    parents = [-1, 0, 0, 0, 2, 2, 4]
    ad.observe_tree(parents, [0, 2, 5])  # depth 1: 2 tried, one kept; depth 2: 2 tried, one kept; 5 is a leaf
    assert (ad.sums[:2], ad.counts[:2]) == ([1.0, 1.0], [2.0, 2.0])
    ad.observe_tree(parents, [0])  # every child of the root rejected: 3 trials at depth 1, nothing deeper
    assert (ad.sums[:3], ad.counts[:3]) == ([1.0, 1.0, 0.0], [5.0, 2.0, 0.0])
    assert ad.estimate()[0] == pytest.approx((1 + 0.5) / (5 + 1))
    for _ in range(30):  # nothing kept for a while: plain decoding beats every tree and chain
        ad.observe_tree(parents, [0])
    assert ad.speedups()[0] == max(ad.speedups()) and ad.choose() == 0


def test_round_times_correct_the_cost_model():
    """Drafted rounds that take 5 plain rounds where the model says 1.9: speculation goes off, for chains; trees,
    not yet timed, are still scored by the model alone, so the next probe tries one."""
    ad = Adaptive([0.9, 0.9, 0.9], Costs(R, 0.1), pass_s=0.01, settings=DYNAMIC)
    assert ad.choose() == 0  # the unit first: plain rounds are timed before anything drafts
    ad.observe_time(0, 0.01)
    ad.observe_time(0, 0.01)
    assert ad.settings[ad.choose()].kind == "tree"  # the model alone: cheap width, good α
    for _ in range(20):
        ad.observe_time(0, 0.01)
        ad.observe_time(2, 0.05)  # γ = 2: model cost r(3) + 2c = 1.26
    assert ad.overhead["chain"] == pytest.approx(5 - 1.26, rel=0.05)
    assert max(ad.speedups()[1:3]) < 1.0 < max(ad.speedups()[3:])
    for _ in range(20):  # and trees turn out as slow
        ad.observe_time(3, 0.2)
    assert ad.choose() == 0


@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3"])
def test_adaptive_tree_greedy_equals_target(family, chaotic_target):
    """A head right about half the time: the rounds mix plain decoding, chains and trees (static for Medusa,
    dynamic for EAGLE), and the text is still the target's greedy text."""
    model = runner_model(chaotic_target)
    head = perturbed_head(family, chaotic_target, model)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(9))
    ref, gaps = hf_greedy(chaotic_target.model, prompt, 50)
    dec = Decoder(model, OracleHead(head, prompt.tolist() + ref, hit=0.55), adaptive=flip_prone(family))
    out, stats = generate(dec, prompt, 50)
    assert_same_greedy(out, ref, gaps)
    rounds = kinds(dec)
    assert min(rounds["plain"], rounds["chain"], rounds["tree"]) >= 2, rounds
    assert stats.summary()["tau_measured"] > 1.2  # drafts were kept: multi-token rounds and compaction ran


def sampled_runs(model, head, prompts, family, n=150):
    outs, rounds = [], Counter()
    for i, prompt in enumerate(prompts):
        dec = Decoder(model, head, Sampling(1.0), seed=i, adaptive=flip_prone(family))
        outs.append(generate(dec, prompt, n)[0])
        rounds += kinds(dec)
    return outs, rounds


def keep_first_branch(tokens, parents, draft_probs, target_probs, generator, scheme):
    """A broken rule: keep the first child all the way down (tokens from the draft, not the target)."""
    path, node = [0], 0
    while node in parents[1:]:
        node = parents.index(node, 1)
        path.append(node)
    final = target_probs[0, node].argmax(-1, keepdim=True)
    return torch.tensor([path]), torch.tensor([len(path) - 1]), final


@pytest.mark.parametrize("family", ["medusa", "eagle"])
def test_adaptive_tree_sampling_follows_target(family, chaotic_target, monkeypatch):
    """T = 1 through switches between plain rounds, chains and trees (Medusa's sampled static trees verify
    "without_replacement", EAGLE-2's "fixed"): the tokens follow the target; keeping the first branch of every
    tree instead fails the same check."""
    model = runner_model(chaotic_target)
    head = perturbed_head(family, chaotic_target, model)
    prompts = [torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    outs, rounds = sampled_runs(model, head, prompts, family)
    assert rounds["plain"] > 30 and rounds["chain"] > 30 and rounds["tree"] > 15, rounds
    assert pit_pvalue(chaotic_target, prompts, outs) > 1e-3
    if family == "eagle":  # the check has power (one family suffices: it is the same check)
        monkeypatch.setattr(generate_module, "verify_tree_batched", keep_first_branch)
        wrong, rounds = sampled_runs(model, head, prompts, family)
        assert rounds["tree"] > 15 and pit_pvalue(chaotic_target, prompts, wrong) < 1e-3


def test_auto_reads_the_chain_figures(tmp_path):
    """acceptance.json with alpha_chain / the chain-walk τ: chains are predicted from the walk, trees from
    alpha_chain; a record without them falls back to the product of mean α, and says so."""
    path = tmp_path / "acceptance.json"
    record = {"alpha": [0.8, 0.7], "temperature": 0.0, "alpha_by_temperature": {"0.0": [0.8, 0.7]}}
    path.write_text(json.dumps(record))
    old = auto.read_acceptance(path, 0.0)
    assert old["source"] == auto.PRODUCT and old["alpha"] == [0.8, 0.7] and old["tau_chain"] is None
    record.update(alpha_chain_by_temperature={"0.0": [0.8, 0.5]},
                  tau_predicted_by_temperature={"0.0": {"1": 1.7, "2": 1.9}})
    path.write_text(json.dumps(record))
    new = auto.read_acceptance(path, 0.0)
    assert new["source"] == auto.CHAIN_WALK and new["alpha"] == [0.8, 0.5] and new["tau_chain"] == {1: 1.7, 2: 1.9}
    costs = Costs({1: 1.0, 2: 1.0, 3: 1.0}, 0.0)
    table = auto.choose("eagle", None, new["alpha"], costs, None, new["tau_chain"])["table"]
    assert [row["tau_predicted"] for row in table] == [1.0, 1.7, 1.9]  # the walk, not 1 + 0.8 + 0.8·0.5
    tree = Setting.dynamic_tree(2, 1, 2)
    assert auto.predict(tree, new["alpha"], costs)["tau_predicted"] == pytest.approx(1 + 0.8 + 0.4)
