"""The acceptance rule: which drafted tokens the target keeps, exactly, for chains and token trees.

Chain (Leviathan et al. 2023, Chen et al. 2023): draft token x_i is kept with probability min(1, p_i(x)/q_i(x));
at the first rejection one token is drawn from norm(max(0, p_i − q_i)); when all γ are kept a bonus token is drawn
from p_{γ+1}. The emitted tokens then follow the target's own distribution p exactly.

Tree (SpecInfer, Miao et al. 2024; multi-candidate / recursive rejection sampling, Yang et al. 2024, Jeon et al.
2024): at a node, its children are tried in index order against a residual target distribution R (R starts as p at
the node); child m with token x, proposed from distribution s_m, is kept with probability min(1, R(x)/s_m(x)); on
rejection R <- norm(max(0, R − s_m)). If no child is kept, the final token is drawn from R. One lemma makes every
scheme below exact: if x ~ s and R' = norm(max(0, R − s)), then "keep x w.p. min(1, R(x)/s(x)), else draw from R'"
yields exactly R — and by induction the same holds when "draw from R'" is replaced by "try the next child against
R'", as long as the next child's proposal s_{m+1} depends only on the earlier children, never on the coin flips.
``scheme`` says what s_m is, i.e. how the tree's siblings were produced:

- "fixed" (default): s_m = one_hot(x_m). Keep x w.p. R(x); on rejection zero R(x) and renormalise. Exact for ANY
  tree whose tokens do not depend on the verification's random numbers: Medusa static trees, EAGLE-2 top-k trees
  (reranked by cumulative draft probability), even sampled ones. Ignores draft_probs. Greedy-optimal for top-k trees.
- "iid": s_m = q (the draft distribution at the parent). Exact only when siblings were drawn i.i.d. from q (with
  replacement); a chain is a tree with one child per node, and this scheme then equals ``verify_chain``.
- "without_replacement": s_m = q with the earlier siblings' tokens removed, renormalised. Exact only when siblings
  were drawn one after another without replacement from q, in index order (Gumbel top-k, sorted, does this).

Using "iid" on a top-k tree is NOT exact (tests/serve/test_verify.py shows the χ² test failing); when in doubt use
"fixed". A proposed token with s_m(x) = 0 cannot have been drawn from s_m: it is skipped (rejected, R unchanged),
which keeps the rule exact. In a chain such a token is rejected and the next token is drawn from p itself.

Greedy (temperature 0): heads.sampling.probs_from_logits gives one-hot p at argmax, so every rule above reduces to
"keep while the drafted token equals argmax p", and the final token is that argmax. torch.argmax returns the FIRST
maximal index, so ties go to the lowest token id — in the draft and in the target alike — and greedy speculative
output equals the target's own greedy output token for token (up to floating-point differences between passes).

Sampling uses the exponential race argmax(p / E), E ~ Exp(1) (gpt-fast's multinomial without a host sync). Each
single-sequence call syncs with the host once, for the accepted length. ``generator`` must live on the device of the
probabilities. All probabilities are float [..., V] rows already processed by ``probs_from_logits`` with the SAME
temperature / top-k / top-p for draft and target (exactness holds for the processed distributions).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] probabilities (need not sum to 1) -> [...] long, without a host sync.

    Tokens with probability 0 are never drawn (they score -1, every other token scores > 0 or +inf).
    """
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).masked_fill(probs <= 0, -1.0).argmax(-1)


def _normalise(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(-1, keepdim=True).clamp_min(1e-30)


def _renormalise_or(left: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """norm(left), or ``fallback`` where nothing is left (p == s, or only floating-point dust)."""
    mass = left.sum(-1, keepdim=True)
    return torch.where(mass > 0, left / mass.clamp_min(1e-30), fallback)


def _residual(target_probs: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − s)), falling back to p when nothing is left."""
    return _renormalise_or((target_probs - proposal).clamp_min(0), target_probs)


# ----------------------------------------------------------------------------------------------------------- chain

def verify_chain_batched(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                         generator: torch.Generator | None = None):
    """B independent chains at once, no host sync.

    draft_tokens [B, γ] long, draft_probs [B, γ, V], target_probs [B, γ+1, V] ->
    (n_accepted [B] long in 0..γ, next_token [B] long): emit draft_tokens[b, :n_accepted[b]] then next_token[b].
    """
    B, G = draft_tokens.shape
    x = draft_tokens.unsqueeze(-1)  # [B, G, 1]
    draft_x = draft_probs.gather(-1, x).squeeze(-1)  # [B, G]
    target_x = target_probs[:, :G].gather(-1, x).squeeze(-1)  # [B, G]
    u = torch.rand(B, G, generator=generator, device=target_probs.device)
    # u < p/q written without the division; q(x) = 0 means x was not drawn from q: reject it (handled below)
    keep = (u * draft_x < target_x) & (draft_x > 0)  # [B, G]
    n_accepted = keep.long().cumprod(-1).sum(-1)  # [B]: index of the first rejection, γ if none
    rows = torch.arange(B, device=target_probs.device)
    target_n = target_probs[rows, n_accepted]  # [B, V]
    # the bonus position has no draft: pad q with zeros so its "residual" is p_{γ+1} itself
    draft_n = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, draft_probs.shape[-1])], 1)[rows, n_accepted]
    junk = torch.cat([draft_x <= 0, draft_x.new_zeros(B, 1, dtype=torch.bool)], 1)[rows, n_accepted]  # [B]
    residual = _residual(target_n, draft_n)
    # a junk draft token carries no information: draw from p, exactly as if it had never been drafted
    residual = torch.where(junk.unsqueeze(-1), target_n, residual)
    return n_accepted, sample(residual, generator)


def verify_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """draft_tokens [γ], draft_probs [γ, V], target_probs [γ+1, V] -> emitted tokens [n+1] (1 to γ+1).

    One host sync (the accepted length). draft_probs[i] is the distribution draft_tokens[i] was drawn from.
    """
    n_accepted, next_token = verify_chain_batched(draft_tokens[None], draft_probs[None], target_probs[None], generator)
    n = int(n_accepted[0])  # the host sync
    return torch.cat([draft_tokens[:n], next_token])


# ------------------------------------------------------------------------------------------------------------ tree

class Tree(NamedTuple):
    """A token tree. Node 0 is the root (the last accepted position); parents[i] < i for every other node.

    tokens [N] long on the probabilities' device (tokens[0] is the root's token, unused here); parents: N ints on
    the host (a list, or a CPU tensor), parents[0] = -1. Siblings are tried in increasing node index.
    """
    tokens: torch.Tensor
    parents: Sequence[int] | torch.Tensor


class TreeVerdict(NamedTuple):
    """path [n+1]: accepted nodes from the root (path[0] = 0); tokens [n+1]: the emitted tokens.

    tokens[i] is what the target said after node path[i]: tree tokens of path[1:], then one final token drawn from
    the residual at path[-1]. Keep the KV entries of the ``path`` nodes.
    """
    path: torch.Tensor
    tokens: torch.Tensor


SCHEMES = ("fixed", "iid", "without_replacement")


def _parents_list(parents) -> list[int]:
    parents = parents.tolist() if torch.is_tensor(parents) else [int(p) for p in parents]
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i), \
        "parents[0] must be -1 and parents[i] < i (a node comes after its parent)"
    return parents


def tree_depths(parents) -> torch.Tensor:
    """[N] long depth of each node (root 0): the runner's position ids are start + depth."""
    parents = _parents_list(parents)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return torch.tensor(depth)


def tree_attention_bias(parents, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[N, N] additive mask: 0 where node j is an ancestor of node i or i itself, -inf elsewhere.

    Float, not bool: HF eager attention reads 4D bool masks wrongly. Every row has its diagonal, so no row is all -inf.
    """
    parents = _parents_list(parents)
    N = len(parents)
    visible = torch.eye(N, dtype=torch.bool)
    for i in range(1, N):
        visible[i] |= visible[parents[i]]  # parents come first, so visible[parent] is already complete
    bias = torch.zeros(N, N, dtype=dtype).masked_fill(~visible, float("-inf"))
    return bias.to(device) if device is not None else bias


def _children(parents: list[int]):
    """-> (kids [N, K] long with -1 padding, in index order; max depth D)."""
    N = len(parents)
    kids: list[list[int]] = [[] for _ in range(N)]
    depth = [0] * N
    for i in range(1, N):
        kids[parents[i]].append(i)
        depth[i] = depth[parents[i]] + 1
    K = max(1, max(len(k) for k in kids))
    table = torch.full((N, K), -1, dtype=torch.long)
    for i, k in enumerate(kids):
        table[i, :len(k)] = torch.tensor(k, dtype=torch.long)
    return table, max(depth)


def verify_tree_batched(tokens: torch.Tensor, parents, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                        generator: torch.Generator | None = None, scheme: str = "fixed"):
    """B trees of one shape at once, no host sync.

    tokens [B, N] long, parents N host ints, draft_probs [B, N, V] (row j: the draft distribution the children of node
    j were drawn from; unused by "fixed", may be None), target_probs [B, N, V] (row j: the target after node j) ->
    (path [B, D+1] long, accepted nodes from the root padded with -1; n_accepted [B]; next_token [B]).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {SCHEMES}")
    parents = _parents_list(parents)
    device = target_probs.device
    B, N, V = target_probs.shape
    if scheme != "fixed" and draft_probs is None:
        raise ValueError(f"scheme {scheme!r} needs draft_probs")
    kids, D = _children(parents)
    has_kids = set(parents[1:])
    inner = torch.tensor([j for j in range(N) if j in has_kids], dtype=torch.long)  # [J] nodes with children
    slot = torch.full((N,), -1, dtype=torch.long)  # [N] node -> its row in the [B, J, V] tensors, -1 for leaves
    slot[inner] = torch.arange(len(inner))
    # built on the host; non_blocking copies from pageable memory do not wait for queued GPU work (no sync)
    kids, inner, slot = (t.to(device, non_blocking=True) for t in (kids, inner, slot))
    rows = torch.arange(B, device=device)

    # 1. every child's keep flag, assuming its earlier siblings were all rejected (the only case in which it is tried)
    residual = target_probs[:, inner].float()  # [B, J, V]: R at each inner node
    draft = draft_probs[:, inner].float() if scheme != "fixed" else None  # [B, J, V]
    # [B, J, V] tokens already proposed at each inner node (without_replacement only)
    proposed = torch.zeros_like(residual, dtype=torch.bool) if scheme == "without_replacement" else None
    keep = torch.zeros(B, N, dtype=torch.bool, device=device)
    for m in range(kids.shape[1]):
        child = kids[inner, m]  # [J], -1 where the node has fewer than m+1 children
        x = tokens[:, child.clamp_min(0)].unsqueeze(-1)  # [B, J, 1]
        residual_x = residual.gather(-1, x).squeeze(-1)  # [B, J]
        if scheme == "fixed":  # s = one_hot(x): R - s clipped at 0 is R with R(x) zeroed
            proposal_x = torch.ones_like(residual_x)
            rejected = _renormalise_or(residual.scatter(-1, x, 0.0), residual)
        else:
            proposal = draft if scheme == "iid" else _normalise(draft.masked_fill(proposed, 0.0))
            if scheme == "without_replacement":
                proposed = proposed.scatter(-1, x, True)
            proposal_x = proposal.gather(-1, x).squeeze(-1)  # [B, J]
            rejected = _residual(residual, proposal)
        u = torch.rand(B, len(inner), generator=generator, device=device)
        tried = (child >= 0) & (proposal_x > 0)  # [B, J]: a token with s(x) = 0 is skipped, R unchanged
        keep[:, child.clamp_min(0)] |= tried & (u * proposal_x < residual_x)  # only real children can be True
        residual = torch.where(tried.unsqueeze(-1), rejected, residual)

    # 2. walk down: at each node take the first kept child (vectorised over B; D small steps, no sync)
    node = torch.zeros(B, dtype=torch.long, device=device)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    alive = torch.ones(B, dtype=torch.bool, device=device)
    for d in range(D):
        candidates = kids[node]  # [B, K]
        kept = keep.gather(1, candidates.clamp_min(0)) & (candidates >= 0)  # [B, K]
        alive = alive & kept.any(-1)
        step = candidates.gather(1, kept.long().argmax(-1, keepdim=True)).squeeze(1)  # first kept child
        node = torch.where(alive, step, node)
        path[:, d + 1] = torch.where(alive, step, -1)
    n_accepted = (path >= 0).sum(-1) - 1
    # where the walk stopped: an inner node draws from R after all its children were rejected, a leaf from p (bonus)
    final = target_probs[rows, node].float()  # [B, V]
    if len(inner):
        final = torch.where((slot[node] >= 0).unsqueeze(-1), residual[rows, slot[node].clamp_min(0)], final)
    return path, n_accepted, sample(final, generator)


def verify_tree(tree: Tree, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                generator: torch.Generator | None = None, scheme: str = "fixed") -> TreeVerdict:
    """One tree: tree.tokens [N], draft_probs [N, V] or None, target_probs [N, V] -> TreeVerdict(path, tokens).

    Row j of target_probs is the target's distribution after node j (row 0: after the root); row j of draft_probs
    is the draft distribution node j's children were drawn from. See the module docstring for ``scheme``.
    One host sync (the accepted length).
    """
    path, n_accepted, next_token = verify_tree_batched(
        tree.tokens[None], tree.parents, None if draft_probs is None else draft_probs[None], target_probs[None],
        generator, scheme)
    n = int(n_accepted[0])  # the host sync
    path = path[0, :n + 1]
    return TreeVerdict(path, torch.cat([tree.tokens[path[1:]], next_token]))
