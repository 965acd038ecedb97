"""Exactness of serve/verify.py on synthetic models: χ² tests that emitted tokens follow the target, and greedy paths.

The toy "models" are next-token tables indexed by (position, last token), so the second emitted token's distribution
depends on the first: the first two tokens of the output must follow p(y1) p(y2 | y1). When a round emits only one
token, the second comes from a fresh round drafted from the prefix y1 (exactly what the decode loop does). The same
χ² check is shown to FAIL for deliberately wrong rules, so passing it means something.
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from heads.sampling import probs_from_logits
from serve.verify import (Tree, tree_attention_bias, tree_depths, verify_chain, verify_chain_batched, verify_tree,
                          verify_tree_batched)

V = 10  # vocabulary of the toy models
CTX = V  # "last token" of the empty prefix
POS = 6  # positions the toy models know (two rounds of depth ≤ 3 need 5)
SAMPLES = 100_000
P_MIN = 1e-3
GAMMA = 3
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4]  # depth 3, up to three siblings per node

TARGET = torch.randn(POS, V + 1, V, generator=torch.Generator().manual_seed(0)) * 2.0
DRAFTS = {
    "good": TARGET + 0.4 * torch.randn(POS, V + 1, V, generator=torch.Generator().manual_seed(1)),
    "poor": torch.randn(POS, V + 1, V, generator=torch.Generator().manual_seed(2)) * 0.7,
}
# (temperature, top_k, top_p): both temperatures, each with a filter that leaves zero-probability tokens behind
SETTINGS = {"T1-topk4": (1.0, 4, 1.0), "T0.7-topp0.8": (0.7, 0, 0.8)}
PLAIN = (1.0, 0, 1.0)


def chi2_pvalue(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """χ² goodness of fit; cells expecting < 5 are pooled; a sample in a zero-probability cell gives 0."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    expected = expected.double().flatten()
    if counts[expected == 0].sum() > 0:
        return 0.0
    expected = expected / expected.sum() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


# ----------------------------------------------------------------------------------- one round of each verifier
# Each round function: (P, Q [POS, V+1, V] processed tables, pos, last [B], gen) -> (emitted [B, ≥1], n_accepted [B]);
# emitted[b, :n_accepted[b] + 1] are the round's tokens.

def chain_round(P, Q, pos, last, gen, wrong=False):
    B = last.shape[0]
    drafted, draft_rows, target_rows = [], [], []
    for i in range(GAMMA):
        target_rows.append(P[pos + i, last])
        draft_rows.append(Q[pos + i, last])
        last = torch.multinomial(draft_rows[-1], 1, generator=gen)[:, 0]
        drafted.append(last)
    target_rows.append(P[pos + GAMMA, last])
    drafted, target_probs = torch.stack(drafted, 1), torch.stack(target_rows, 1)  # [B, γ], [B, γ+1, V]
    n, nxt = verify_chain_batched(drafted, torch.stack(draft_rows, 1), target_probs, gen)
    if wrong:  # the classic bug: on rejection resample from p instead of the residual
        rows = torch.arange(B)
        resampled = torch.multinomial(target_probs[rows, n], 1, generator=gen)[:, 0]
        nxt = torch.where(n < GAMMA, resampled, nxt)
    emitted = torch.cat([drafted, nxt[:, None]], 1)
    emitted[torch.arange(B), n] = nxt
    return emitted, n


def build_tree(Q, pos, last, gen, siblings):
    """Tokens [B, N] and lookup keys [B, N] (the node's own token; the context at the root) for PARENTS."""
    B, N = last.shape[0], len(PARENTS)
    depth = tree_depths(PARENTS)
    tokens = torch.zeros(B, N, dtype=torch.long)
    keys = torch.zeros(B, N, dtype=torch.long)
    keys[:, 0] = last
    tokens[:, 0] = last.clamp_max(V - 1)  # the root's token is never verified; keep it a valid id
    for j in range(N):
        kids = [i for i in range(1, N) if PARENTS[i] == j]
        if not kids:
            continue
        q = Q[pos + depth[j], keys[:, j]]  # [B, V]
        if siblings == "topk":  # EAGLE-2 / Medusa style: deterministic top-k of the draft
            chosen = q.topk(len(kids), -1).indices
        elif siblings == "iid":
            chosen = torch.multinomial(q, len(kids), replacement=True, generator=gen)
        else:  # Gumbel top-k = sequential sampling without replacement, in sorted order
            gumbel = -torch.empty_like(q).exponential_(generator=gen).log()
            chosen = (q.log() + gumbel).topk(len(kids), -1).indices
        tokens[:, kids] = chosen
        keys[:, kids] = chosen
    return tokens, keys, depth


def tree_round(P, Q, pos, last, gen, siblings, scheme):
    tokens, keys, depth = build_tree(Q, pos, last, gen, siblings)
    at = pos + depth[None, :]  # [1, N] position of each node's next token
    draft_probs = None if scheme == "fixed" else Q[at, keys]  # "fixed" never reads the draft distribution
    path, n, nxt = verify_tree_batched(tokens, PARENTS, draft_probs, P[at, keys], gen, scheme)
    emitted = torch.cat([tokens.gather(1, path[:, 1:].clamp_min(0)), nxt[:, None]], 1)  # [B, D+1]
    emitted[torch.arange(len(n)), n] = nxt
    return emitted, n


VERIFIERS = {
    "chain": chain_round,
    "tree-topk-fixed": lambda *a: tree_round(*a, "topk", "fixed"),
    "tree-iid-iid": lambda *a: tree_round(*a, "iid", "iid"),
    "tree-wor-wor": lambda *a: tree_round(*a, "wor", "without_replacement"),
}


def first_two(round_fn, P, Q, gen, B=SAMPLES):
    """The first two tokens of the output sequence [B], [B] (a second round where the first emitted one token)."""
    emitted, n = round_fn(P, Q, 0, torch.full((B,), CTX), gen)
    y1, y2 = emitted[:, 0], emitted[:, 1].clone()
    again = n == 0
    y2[again] = round_fn(P, Q, 1, y1[again], gen)[0][:, 0]
    return y1, y2


def assert_target_distribution(round_fn, draft, setting, seed=0):
    T, top_k, top_p = SETTINGS.get(setting, PLAIN)
    P = probs_from_logits(TARGET, T, top_k, top_p)
    Q = probs_from_logits(DRAFTS[draft], T, top_k, top_p)
    y1, y2 = first_two(round_fn, P, Q, torch.Generator().manual_seed(seed))
    first = chi2_pvalue(y1, P[0, CTX])
    pair = chi2_pvalue(y1 * V + y2, P[0, CTX][:, None] * P[1, :V])  # p(y1) p(y2 | y1)
    return first, pair


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_emitted_tokens_follow_target(verifier, draft, setting):
    first, pair = assert_target_distribution(VERIFIERS[verifier], draft, setting)
    assert first > P_MIN and pair > P_MIN, (first, pair)


@pytest.mark.slow
def test_fixed_scheme_is_exact_for_sampled_trees_too():
    first, pair = assert_target_distribution(lambda *a: tree_round(*a, "iid", "fixed"), "poor", "plain")
    assert first > P_MIN and pair > P_MIN, (first, pair)


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["chain-resample-from-p", "tree-topk-as-iid", "tree-wor-as-iid"])
def test_wrong_rules_fail_the_same_check(wrong):
    round_fn = {"chain-resample-from-p": lambda *a: chain_round(*a, wrong=True),
                "tree-topk-as-iid": lambda *a: tree_round(*a, "topk", "iid"),
                "tree-wor-as-iid": lambda *a: tree_round(*a, "wor", "iid")}[wrong]
    first, pair = assert_target_distribution(round_fn, "poor", "plain")
    assert min(first, pair) < P_MIN, (first, pair)


# --------------------------------------------------------------------------------------------------------- greedy

def tied_logits(*shape, seed):
    """Integer logits in 0..3: many exact ties, so tie handling is exercised."""
    return torch.randint(0, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


def lowest_argmax(logits: torch.Tensor) -> int:
    return int((logits == logits.max()).nonzero()[0])


@pytest.mark.parametrize("soft_draft", [False, True])
def test_greedy_chain_emits_target_argmax_path(soft_draft):
    gen = torch.Generator().manual_seed(0)
    for case in range(200):
        target_logits = tied_logits(GAMMA + 1, V, seed=case)
        # a draft that agrees with the target's (lowest-index) argmax for a random number of steps, then deviates
        agree = case % (GAMMA + 2)
        draft_tokens = torch.tensor([lowest_argmax(target_logits[i]) if i < agree else
                                     (lowest_argmax(target_logits[i]) + 1 + case % (V - 1)) % V for i in range(GAMMA)])
        draft_logits = torch.randn(GAMMA, V, generator=gen)
        draft_logits[torch.arange(GAMMA), draft_tokens] = 10.0
        draft_probs = probs_from_logits(draft_logits, 1.0 if soft_draft else 0.0)
        out = verify_chain(draft_tokens, draft_probs, probs_from_logits(target_logits, 0.0), gen)
        n = min(agree, GAMMA)
        assert out.tolist() == [lowest_argmax(target_logits[i]) for i in range(n + 1)]


def random_tree(n_nodes, gen):
    return [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n_nodes)]


@pytest.mark.parametrize("scheme", ["fixed", "iid", "without_replacement"])
def test_greedy_tree_follows_target_argmax(scheme):
    gen = torch.Generator().manual_seed(0)
    for case in range(200):
        parents = random_tree(int(torch.randint(1, 16, (), generator=gen)), gen)
        N = len(parents)
        target_logits = tied_logits(N, V, seed=case)
        best = [lowest_argmax(row) for row in target_logits]
        # children hit their parent's argmax half the time (duplicates among siblings included)
        tokens = torch.tensor([best[parents[i]] if i and torch.rand((), generator=gen) < 0.5 else
                               int(torch.randint(0, V, (), generator=gen)) for i in range(N)])
        draft_probs = torch.rand(N, V, generator=gen)
        draft_probs[torch.arange(1, N), tokens[1:]] += 1  # wherever a token came from, the draft could propose it
        draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True)
        # the draft rows are indexed by parent: node j's row is what its children were drawn from
        draft_rows = draft_probs.clone()
        for i in range(1, N):
            draft_rows[parents[i], tokens[i]] = max(draft_rows[parents[i], tokens[i]], 0.05)
        verdict = verify_tree(Tree(tokens, parents), draft_rows, probs_from_logits(target_logits, 0.0), gen, scheme)
        # reference walk: first child (in index order) equal to the argmax, then the argmax at the last node
        path, node = [0], 0
        while True:
            hit = [i for i in range(1, N) if parents[i] == node and int(tokens[i]) == best[node]]
            if not hit:
                break
            node = hit[0]
            path.append(node)
        assert verdict.path.tolist() == path
        assert verdict.tokens.tolist() == [int(tokens[i]) for i in path[1:]] + [best[node]]


# ------------------------------------------------------------------------------------------ API and consistency

def test_single_calls_equal_batched_and_chain_equals_iid_tree():
    P = probs_from_logits(TARGET, 1.0)
    Q = probs_from_logits(DRAFTS["poor"], 1.0)
    last = torch.full((1,), CTX)
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        draft_tokens, draft_rows, target_rows = [], [Q[0, CTX]], [P[0, CTX]]
        for i in range(GAMMA):
            draft_tokens.append(int(torch.multinomial(draft_rows[-1], 1, generator=gen)))
            target_rows.append(P[i + 1, draft_tokens[-1]])
            draft_rows.append(Q[i + 1, draft_tokens[-1]])
        tokens, draft_probs, target_probs = torch.tensor(draft_tokens), torch.stack(draft_rows), torch.stack(target_rows)
        out = verify_chain(tokens, draft_probs[:GAMMA], target_probs, torch.Generator().manual_seed(seed))
        n, nxt = verify_chain_batched(tokens[None], draft_probs[None, :GAMMA], target_probs[None],
                                      torch.Generator().manual_seed(seed))
        assert out.tolist() == tokens[:int(n)].tolist() + [int(nxt)]
        # a chain is a tree with one child per node; the "iid" scheme is then the chain rule, random draws included
        chain_tree = Tree(torch.cat([last.clamp_max(V - 1), tokens]), list(range(-1, GAMMA)))
        verdict = verify_tree(chain_tree, draft_probs, target_probs, torch.Generator().manual_seed(seed), "iid")
        assert verdict.tokens.tolist() == out.tolist()
        assert verdict.path.tolist() == list(range(len(out)))


def test_draft_token_the_draft_could_not_propose_is_rejected():
    target_probs = torch.zeros(2, V)
    target_probs[:, 3] = 1.0
    draft_probs = torch.zeros(1, V)
    draft_probs[0, 5] = 1.0  # q(3) = 0, yet 3 is "drafted"
    out = verify_chain(torch.tensor([3]), draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert out.tolist() == [3]  # rejected, then drawn from p itself (one-hot at 3), not from an empty residual


def test_tree_attention_bias_is_the_ancestor_mask():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        parents = random_tree(int(torch.randint(1, 30, (), generator=gen)), gen)
        bias = tree_attention_bias(parents, torch.bfloat16)
        depth = tree_depths(parents)
        assert bias.dtype == torch.bfloat16 and bias.shape == (len(parents), len(parents))
        for i in range(len(parents)):
            ancestors, node = {i}, i
            while parents[node] >= 0:
                node = parents[node]
                ancestors.add(node)
            assert {j for j in range(len(parents)) if bias[i, j] == 0} == ancestors
            assert bool(torch.isinf(bias[i]).all().logical_not()) and int(depth[i]) == len(ancestors) - 1
