"""Exactness of serve/verify.py on synthetic models: χ² tests that emitted tokens follow the target, and greedy paths.

The toy "models" are next-token tables indexed by (position, last token), so each emitted token's distribution
depends on the one before: the first four tokens of the output must follow p(y1) p(y2 | y1) p(y3 | y2) p(y4 | y3).
Rounds draft to depth 3, so those four tokens reach every drafted depth and the bonus token; when a round emits
fewer, the rest come from fresh rounds drafted from the tokens so far (exactly what the decode loop does). The bonus
token is also checked on its own: after a round that kept all three drafted tokens, y4 must follow p(y4 | y3). The
same χ² checks are shown to FAIL for deliberately wrong rules, each one wrong only where a check looks, so passing
them means something.
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
GAMMA = 3
TOKENS = GAMMA + 1  # tokens checked: every drafted depth, then the bonus
POS = TOKENS + GAMMA  # positions the toy models know: a round of depth 3 started at the fourth token reads 7
SAMPLES = 100_000
P_MIN = 1e-3
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4]  # depth 3, up to three siblings per node

TARGET = torch.randn(POS, V + 1, V, generator=torch.Generator().manual_seed(0)) * 2.0
DRAFTS = {
    "good": TARGET + 0.4 * torch.randn(POS, V + 1, V, generator=torch.Generator().manual_seed(1)),
    "poor": torch.randn(POS, V + 1, V, generator=torch.Generator().manual_seed(2)) * 0.7,
}
# (temperature, top_k, top_p): both temperatures, each with a filter that leaves zero-probability tokens behind
SETTINGS = {"T1-topk4": (1.0, 4, 1.0), "T0.7-topp0.8": (0.7, 0, 0.8)}
PLAIN = (1.0, 0, 1.0)


def chi2_pvalue(samples: torch.Tensor, expected: torch.Tensor, ddof: int = 0) -> float:
    """χ² goodness of fit; cells expecting < 5 are pooled; a sample in a zero-probability cell gives 0.

    ``ddof``: degrees of freedom spent on margins taken from the samples themselves."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    expected = expected.double().flatten()
    if counts[expected == 0].sum() > 0:
        return 0.0
    expected = expected / expected.sum() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy(), ddof=ddof).pvalue)


# ----------------------------------------------------------------------------------- one round of each verifier
# Each round function: (P, Q [POS, V+1, V] processed tables, pos, last [B], gen) -> (emitted [B, ≥1], n_accepted [B]);
# emitted[b, :n_accepted[b] + 1] are the round's tokens.

def chain_round(P, Q, pos, last, gen, wrong=None):
    B = last.shape[0]
    drafted, draft_rows, target_rows = [], [], []
    for i in range(GAMMA):
        target_rows.append(P[pos + i, last])
        draft_rows.append(Q[pos + i, last])
        last = torch.multinomial(draft_rows[-1], 1, generator=gen)[:, 0]
        drafted.append(last)
    target_rows.append(P[pos + GAMMA, last])
    drafted, target_probs = torch.stack(drafted, 1), torch.stack(target_rows, 1)  # [B, γ], [B, γ+1, V]
    if wrong == "keep-last-draft":  # the last drafted token is kept whenever its predecessors are (depth 3 only)
        target_probs[:, GAMMA - 1] = torch.nn.functional.one_hot(drafted[:, -1], V).to(target_probs)
    n, nxt = verify_chain_batched(drafted, torch.stack(draft_rows, 1), target_probs, gen)
    rows = torch.arange(B)
    if wrong == "resample-from-p":  # the classic bug: on rejection resample from p instead of the residual
        resampled = torch.multinomial(target_probs[rows, n], 1, generator=gen)[:, 0]
        nxt = torch.where(n < GAMMA, resampled, nxt)
    if wrong == "bonus-from-last-row":  # off by one: the bonus drawn from the row that verified the last draft
        stale = torch.multinomial(target_probs[:, GAMMA - 1], 1, generator=gen)[:, 0]
        nxt = torch.where(n == GAMMA, stale, nxt)
    emitted = torch.cat([drafted, nxt[:, None]], 1)
    emitted[rows, n] = nxt
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


def first_tokens(round_fn, P, Q, gen, B=SAMPLES):
    """The first TOKENS tokens of the output [B, TOKENS], and the first round's n_accepted [B].

    Samples whose rounds emitted fewer tokens get further rounds, drafted from their last token at its position."""
    out = torch.full((B, TOKENS), -1, dtype=torch.long)
    have = torch.zeros(B, dtype=torch.long)
    last = torch.full((B,), CTX)
    first_n = None
    for pos in range(TOKENS):  # every sample has exactly `pos` tokens when its next round starts here
        todo = (have == pos).nonzero()[:, 0]
        if not len(todo):
            continue
        emitted, n = round_fn(P, Q, pos, last[todo], gen)
        first_n = n if pos == 0 else first_n
        m = (n + 1).clamp_max(TOKENS - pos)  # tokens of this round that fall among the first TOKENS
        for j in range(min(emitted.shape[1], TOKENS - pos)):
            got = j < m
            out[todo[got], pos + j] = emitted[got, j]
        have[todo] += m
        last[todo] = out[todo, have[todo] - 1]
    assert bool((have == TOKENS).all())
    return out, first_n


def bonus_pvalue(round_fn, P, gen, wanted=2000, batches=5):
    """χ² p-value of the bonus token on its own: after a round that kept all γ drafts, y4 ~ p(· | y3) at position γ.

    The target drafts for itself here: full rounds are rare with a poor draft, and a top-k tree can have no path
    that the target's filters keep, but with q = p every rule reaches depth γ often."""
    Q = P
    y3, y4 = [], []
    for _ in range(batches):
        emitted, n = round_fn(P, Q, 0, torch.full((SAMPLES,), CTX), gen)
        full = n == GAMMA
        y3.append(emitted[full, GAMMA - 1])
        y4.append(emitted[full, GAMMA])
        if sum(map(len, y3)) >= wanted:
            break
    y3, y4 = torch.cat(y3), torch.cat(y4)
    assert len(y3) >= wanted, f"only {len(y3)} full rounds in {batches * SAMPLES} for the bonus check"
    seen = torch.bincount(y3, minlength=V).double()
    expected = seen[:, None] * P[GAMMA, :V].double()  # y3's own counts × p(y4 | y3): the y3 margin is not tested
    return chi2_pvalue(y3 * V + y4, expected, ddof=int((seen > 0).sum()) - 1)


def target_pvalues(round_fn, draft, setting, seed=0):
    """χ² p-values of the first 1, 2, 3 and 4 tokens' joint law, and of the bonus token after a full round."""
    T, top_k, top_p = SETTINGS.get(setting, PLAIN)
    P = probs_from_logits(TARGET, T, top_k, top_p)
    Q = probs_from_logits(DRAFTS[draft], T, top_k, top_p)
    y, n = first_tokens(round_fn, P, Q, torch.Generator().manual_seed(seed))
    joint, cell, pvalues = P[0, CTX], y[:, 0], {}
    pvalues["y1"] = chi2_pvalue(cell, joint)
    for k in range(1, TOKENS):  # p(y1..yk+1) = p(y1..yk) p(yk+1 | yk); cells are y1..yk+1 read as base-V digits
        joint = joint[..., None] * P[k, :V]  # [V] * (k + 1); P[k, :V] broadcasts over the axes (yk, yk+1)
        cell = cell * V + y[:, k]
        pvalues[f"y1..y{k + 1}"] = chi2_pvalue(cell, joint)
    pvalues["bonus"] = bonus_pvalue(round_fn, P, torch.Generator().manual_seed(seed + 1))
    return pvalues


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_emitted_tokens_follow_target(verifier, draft, setting):
    pvalues = target_pvalues(VERIFIERS[verifier], draft, setting)
    assert min(pvalues.values()) > P_MIN, pvalues


@pytest.mark.slow
def test_fixed_scheme_is_exact_for_sampled_trees_too():
    pvalues = target_pvalues(lambda *a: tree_round(*a, "iid", "fixed"), "poor", "plain")
    assert min(pvalues.values()) > P_MIN, pvalues


# each wrong rule, and the check that must catch it (the others may pass: the rule is wrong only there)
WRONG_RULES = {
    "chain-resample-from-p": (lambda *a: chain_round(*a, wrong="resample-from-p"), "y1"),
    "chain-keep-last-draft": (lambda *a: chain_round(*a, wrong="keep-last-draft"), "y1..y3"),
    "chain-bonus-from-last-row": (lambda *a: chain_round(*a, wrong="bonus-from-last-row"), "bonus"),
    "tree-topk-as-iid": (lambda *a: tree_round(*a, "topk", "iid"), "y1"),
    "tree-wor-as-iid": (lambda *a: tree_round(*a, "wor", "iid"), "y1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", list(WRONG_RULES))
def test_wrong_rules_fail_the_same_check(wrong):
    round_fn, check = WRONG_RULES[wrong]
    pvalues = target_pvalues(round_fn, "poor", "plain")
    assert pvalues[check] < P_MIN, pvalues
    if check != "y1":  # wrong only from depth 3 on: the first two tokens pass, so only the new checks can see it
        assert min(pvalues["y1"], pvalues["y1..y2"]) > P_MIN, pvalues


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
