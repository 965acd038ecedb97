"""Tree drafting and the expected-τ model behind gamma=auto."""
from __future__ import annotations

import time

import pytest
import torch

from heads.losses import tau_predicted
from serve import auto
from serve.generate import Sampling
from serve.setting import Costs, Setting
from serve.tree import MEDUSA_TREE, DynamicTree, StaticTree, expected_tau_dynamic, expected_tau_paths
from tests.serve.conftest import perturbed_head, runner_model

pytestmark = pytest.mark.usefixtures("one_thread")


def committed(family, target, T=12, head=None):
    """(head, a fresh drafting cache with T positions committed, step-1 logits, state)."""
    model = runner_model(target)
    head = head or perturbed_head(family, target, model, std=0.05)
    model.setup_cache(64)
    ids = torch.randint(0, 256, (1, T + 1), generator=torch.Generator().manual_seed(2))
    _, hidden = model(ids[:, :T], 0, hidden_layers=head.feature_layers)
    cache = head.new_cache(64, "cpu", torch.float32)
    logits, state = head.commit(cache, hidden, ids[:, 1:], 0)
    return head, cache, logits, state


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_dynamic_tree_top1_is_the_greedy_chain(family, chaotic_target):
    """top_k = 1 leaves one path: it must be what chain drafting with argmax proposes (step_tree == step)."""
    head, cache, logits, state = committed(family, chaotic_target)
    chain, lg, st = [], logits, state
    for d in range(1, 5):
        chain.append(int(lg.argmax()))
        if d < 4:
            lg, st = head.step(cache, st, torch.tensor([chain[-1]]), d + 1)
    head, cache, logits, state = committed(family, chaotic_target, head=head)
    tree = DynamicTree(depth=4, top_k=1, total_tokens=4).draft(head, cache, logits, state, Sampling(), None)
    assert tree.parents == [-1, 0, 1, 2, 3] and tree.tokens[1:].tolist() == chain


def test_dynamic_tree_shape(chaotic_target):
    head, cache, logits, state = committed("eagle", chaotic_target)
    tree = DynamicTree(depth=4, top_k=3, total_tokens=12).draft(head, cache, logits, state, Sampling(), None)
    parents = tree.parents
    assert len(parents) == 13 and parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    assert tree.depths.max() <= 4 and tree.bias.shape == (13, 13)
    first = [int(tree.tokens[i]) for i in range(1, 13) if parents[i] == 0]
    top = torch.topk(logits[0], 3).indices.tolist()
    assert set(first) <= set(top) and top[0] in first  # the head's favourite is always drafted
    for i in range(1, 13):  # siblings are distinct tokens
        sib = [int(tree.tokens[j]) for j in range(1, 13) if parents[j] == parents[i]]
        assert len(sib) == len(set(sib))


def test_static_tree_greedy_tokens(chaotic_target):
    head, cache, logits, state = committed("medusa", chaotic_target)
    paths = [p for p in MEDUSA_TREE if len(p) <= 3]
    st = StaticTree(paths, "cpu")
    tree = st.draft(head, cache, logits, state, Sampling(), None)
    per_depth = [logits[0]] + [head.step(cache, state, torch.zeros(1, dtype=torch.long), d)[0][0] for d in (2, 3)]
    for i, p in enumerate(st.paths, start=1):
        assert int(tree.tokens[i]) == int(torch.topk(per_depth[len(p) - 1], p[-1] + 1).indices[-1])
        assert st.parents[i] == (0 if len(p) == 1 else st.paths.index(p[:-1]) + 1)
    sampling = Sampling(1.0, top_k=20)
    sampled = st.draft(head, cache, logits, state, sampling, torch.Generator().manual_seed(0))
    assert sampled.scheme == "without_replacement" and sampled.draft_probs.shape == (len(paths) + 1, logits.shape[-1])
    for j in range(len(st.parents)):  # row j: the distribution node j's children were drawn from
        depth = int(st.depths[j])
        if depth < 3:
            torch.testing.assert_close(sampled.draft_probs[j], sampling.probs(per_depth[depth]))
    for i in range(1, len(st.parents)):
        assert sampled.draft_probs[st.parents[i], sampled.tokens[i]] > 0
    for i in range(len(st.parents)):  # without replacement: siblings differ
        sib = [int(sampled.tokens[j]) for j in range(1, len(st.parents)) if st.parents[j] == i]
        assert len(sib) == len(set(sib))


def test_expected_tau_reduces_to_the_chain():
    alphas = [0.8, 0.6, 0.5]
    chain = [(0,), (0, 0), (0, 0, 0)]
    assert expected_tau_paths(alphas, chain) == pytest.approx(tau_predicted(alphas)[3])
    assert expected_tau_dynamic(alphas, 3, 1, 3) == pytest.approx(tau_predicted(alphas)[3])
    assert expected_tau_dynamic(alphas, 3, 4, 24) > expected_tau_dynamic(alphas, 3, 4, 8) > tau_predicted(alphas)[3]


def test_measured_rank_rates_set_the_siblings():
    """With alpha_rank a sibling is kept as often as the head's rank-r token was the target's, scaled to the chain's
    α at rank 0; a head whose second choice never hits gives a tree no more than its chain."""
    alphas = [0.5, 0.4]
    ranks = [[0.4, 0.1, 0.05, 0.0], [0.3, 0.06, 0.0, 0.0]]
    one_level = expected_tau_dynamic(alphas, 1, 4, 4, ranks)
    assert one_level == pytest.approx(1 + 0.5 * (1 + 0.25 + 0.125))
    assert one_level < expected_tau_dynamic(alphas, 1, 4, 4)  # positional: 0.5 (1 + 0.5 + 0.25 + 0.125)
    only_top = [[0.4, 0.0, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0]]
    assert expected_tau_dynamic(alphas, 2, 4, 8, only_top) == pytest.approx(tau_predicted(alphas)[2])
    assert expected_tau_paths(alphas, [(0,), (1,), (0, 0), (0, 1)], ranks) == pytest.approx(
        1 + 0.5 + 0.5 * 0.25 + 0.5 * 0.4 + 0.5 * 0.4 * 0.2)


def test_choose_maximises_predicted_speedup(tmp_path):
    alphas = [0.9, 0.85, 0.8, 0.75]
    r = {n: 1.0 + 0.02 * (n - 1) for n in range(1, 70)}
    cheap = auto.choose("eagle", None, alphas, Costs(r, 0.01), None)
    assert cheap["choice"] == Setting.chain(4)
    dear = auto.choose("eagle", None, alphas, Costs(r, 0.8), None)
    assert dear["choice"] == Setting.chain(1)
    assert all(row["speedup_predicted"] <= dear["predicted"]["speedup_predicted"] for row in dear["table"])
    tree = auto.choose("eagle", None, alphas, Costs(r, 0.01), "dynamic")
    assert tree["choice"].tree == "dynamic"  # nearly free width: a tree beats the chain
    (tmp_path / "acceptance.json").write_text('{"alpha": [0.5], "temperature": 0.0, '
                                              '"alpha_by_temperature": {"0.0": [0.5], "1.0": [0.7, 0.6]}}')
    assert auto.read_alphas(auto.find_acceptance(tmp_path / "head"), 0.9) == ([0.7, 0.6], 1.0)


def test_plain_decoding_wins_when_nothing_pays():
    alphas = [0.3, 0.2]
    r = {1: 1.0, 2: 1.1, 3: 1.8}
    record = auto.choose("eagle", None, alphas, Costs(r, 0.3), None)
    assert record["choice"].kind == "plain" and record["predicted"]["speedup_predicted"] == 1.0
    assert all(row["speedup_predicted"] < 1.0 for row in record["table"] if row.get("gamma") != 0)
    # the same head on cheaper hardware pays: γ = 1 predicts (1 + 0.3) / (1.1 + 0.05) > 1
    assert auto.choose("eagle", None, alphas, Costs(r, 0.05), None)["choice"] == Setting.chain(1)


def test_round_excess_moves_the_choice_off_a_dear_kind():
    """The same α and passes: with a round's excess counted a tree that wins on its passes loses to a chain, and
    with every drafted kind dear plain decoding wins; in plain-round units plain stays exactly 1."""
    alphas, r = [0.6, 0.5, 0.4], {n: 1.0 + 0.01 * (n - 1) for n in range(1, 70)}
    costs = Costs(r, 0.05, pass_s=0.01)
    assert auto.choose("eagle", None, alphas, costs, "dynamic")["choice"].tree == "dynamic"
    chain = auto.choose("eagle", None, alphas, costs, "dynamic", excess={"plain": 0.1, "chain": 0.2, "tree": 2.0})
    assert chain["choice"].kind == "chain" and chain["choice"].gamma > 0, chain["predicted"]
    off = auto.choose("eagle", None, alphas, costs, "dynamic", excess={"plain": 0.1, "chain": 3.0, "tree": 3.0})
    assert off["choice"].kind == "plain" and off["predicted"]["speedup_predicted"] == 1.0
    # the excess is the timed round less its passes, in passes: 30 ms rounds over 10 ms passes
    timed = [Setting.chain(0), Setting.chain(2)]
    excess = auto.round_excess(timed, [0.012, 0.030], costs, alphas)
    assert excess["plain"] == pytest.approx(0.2) and excess["chain"] == pytest.approx(3.0 - (r[3] + 2 * 0.05))


def test_calibrated_choice_sees_what_a_tree_round_costs(tiny_target, monkeypatch):
    """A tree round made 40 ms dearer outside its passes (as a host sync or Python would): time_rounds must see it
    in the tree's excess and not in the chain's, and gamma=auto must then leave the tree that its passes favour."""
    from serve import calibrate

    model = runner_model(tiny_target)
    head = perturbed_head("eagle", tiny_target, model)
    accept = calibrate.accept

    def slow_tree_accept(dec, verdict, hidden):
        if dec.tree is not None:
            time.sleep(0.04)
        return accept(dec, verdict, hidden)

    monkeypatch.setattr(calibrate, "accept", slow_tree_accept)
    alphas = [0.6, 0.5, 0.4]
    model.setup_cache(8)
    one = auto._seconds(lambda: model(torch.ones(1, 1, dtype=torch.long), 0), 5)
    costs = Costs({n: 1.0 + 0.01 * (n - 1) for n in range(1, 70)}, 0.05, pass_s=one)
    record = calibrate.choose(model, head, Sampling(), alphas, costs, "dynamic")
    assert record["passes_only_choice"]["setting"].startswith("dynamic tree"), record["passes_only_choice"]
    assert set(record["round_excess"]) == {"plain", "chain", "tree"}
    extra = 0.04 / costs.pass_s  # the sleep, in passes
    gap = record["round_excess"]["tree"] - record["round_excess"]["chain"]
    assert 0.8 * extra < gap < 1.5 * extra + 3, (gap, extra, record["round_excess"])
    assert record["choice"].kind != "tree", record["predicted"]


def test_measure_costs_follows_the_clock(tiny_target):
    """Give the target a known cost per token and the draft step a known cost (sleeps around the real calls):
    r(n) and c must come out as those ratios, measured at the requested context. A cost model that timed the
    wrong pass, the wrong length or the wrong unit would miss these bands."""
    model = runner_model(tiny_target)
    head = perturbed_head("eagle", tiny_target, model)
    forward, step, calls = model.forward, head.step, []

    def slow_forward(tokens, start, **kw):
        calls.append((tokens.shape[1], start))
        time.sleep(0.04 * tokens.shape[1])
        return forward(tokens, start, **kw)

    def slow_step(*args):
        time.sleep(0.12)
        return step(*args)

    model.forward, head.step = slow_forward, slow_step
    costs = auto.measure_costs(model, head, [1, 2, 5], context=16, reps=2)
    assert {(1, 16), (2, 16), (5, 16)} <= set(calls)  # every timed pass ran after the 16 cached tokens
    # r(n) = (40n ms + overhead) / (40 ms + overhead): the tiny model's own overhead is ~15 ms at most
    assert 1.5 < costs.target_pass(2) < 2.3 and 3.3 < costs.target_pass(5) < 5.6, costs
    assert 1.8 < costs.draft_step < 3.6, costs  # 120 ms ÷ (40 ms + overhead)
