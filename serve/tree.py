"""Token trees: Medusa's static trees, EAGLE-2's dynamic trees, and the expected tokens per pass of each.

A tree is node 0 = the root (the token the target emitted last, not yet in its cache) plus drafted nodes, each
after its parent (``parents[i] < i``). The target scores all nodes in one pass with ``tree_attention_bias``; node
i sits at position start + depth(i) and in slot start + i.

Which nodes are drafted decides which verification rule is exact (serve/verify.py's ``scheme``):
- top-k children (greedy, and EAGLE-2's dynamic trees, which also rerank by cumulative draft probability) are
  chosen without the verifier's random numbers, so "fixed" is exact for them;
- a *static* tree sampled at T > 0 draws each node's children one after another without replacement from q
  (Gumbel top-k), in index order, and verifies with "without_replacement", which accepts like the chain rule
  (Σ min(p, q) for the first child) instead of p(x). EAGLE-2's reranking drops siblings by their values, which
  breaks that rule's premise, so dynamic trees stay "fixed".

Medusa (Cai et al. 2024): a tree is a list of index paths; (i0, i1) is head 0's rank-i0 token followed by head 1's
rank-i1 token. EAGLE-2 (Li et al. 2024): expand the top_k most probable frontier nodes per depth with the head's
top_k children each, then keep the total_tokens nodes of highest cumulative draft log-probability.
"""
from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import torch

from heads.errors import UserError
from serve.setting import Setting
from serve.verify import tree_attention_bias

# A 24-node cut of Medusa's mc_sim_7b_63 tree (the most-visited paths first): depth 4, wide at the top.
MEDUSA_TREE = [
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0), (0, 0, 0), (0, 0, 1),
    (0, 1, 0), (1, 0, 0), (0, 2, 0), (2, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
    (1, 0, 0, 0), (0, 0, 2), (0, 0, 0, 2),
]


@dataclass
class TreeDraft:
    """What verify needs. tokens [N] (tokens[0] is filled with the root by the caller); parents: N host ints."""

    tokens: torch.Tensor
    parents: list[int]
    depths: torch.Tensor  # [N] long, on the device
    bias: torch.Tensor  # [N, N] additive mask, on the device
    draft_probs: torch.Tensor | None  # [N, V]: row j = the distribution node j's children came from
    scheme: str


def gumbel_topk(logp: torch.Tensor, k: int, generator) -> torch.Tensor:
    """k samples without replacement from softmax(logp) [..., V], in draw order ([..., k]; Gumbel top-k)."""
    u = torch.rand(logp.shape, generator=generator, device=logp.device).clamp_(1e-20, 1.0)
    return torch.topk(logp - torch.log(-torch.log(u)), k, dim=-1).indices


class StaticTree:
    """A fixed tree from Medusa index paths; its structure and mask are built once."""

    def __init__(self, paths, device):
        paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        index = {(): 0}
        for i, p in enumerate(paths, start=1):
            if p[:-1] not in index:
                raise ValueError(f"tree path {p} has no parent path {p[:-1]} in the list")
            index[p] = i
        self.paths = paths
        self.parents = [-1] + [index[p[:-1]] for p in paths]
        self.depth = max(len(p) for p in paths)
        self.ranks = torch.tensor([0] + [p[-1] for p in paths], device=device)  # [N]
        depths = [0] + [len(p) for p in paths]
        self.depths = torch.tensor(depths, device=device)
        self.bias = tree_attention_bias(self.parents, torch.float32, device)
        self.size = len(self.parents)
        # child order within each parent (index order): what "without_replacement" pairs with the m-th draw
        seen: dict[int, int] = {}
        order = [0]
        for i in range(1, self.size):
            order.append(seen.get(self.parents[i], 0))
            seen[self.parents[i]] = order[-1] + 1
        self.child_order = torch.tensor(order, device=device)
        self.max_children = max(seen.values())
        self.max_rank = [max(p[-1] for p in paths if len(p) == d) + 1 for d in range(1, self.depth + 1)]
        self.nodes_at = [torch.tensor([i for i in range(self.size) if depths[i] == d], device=device)
                         for d in range(self.depth + 1)]

    def draft(self, head, cache, logits, state, sampling, generator) -> TreeDraft:
        """Medusa-style heads: depth d's distribution does not depend on the drafted parent (``step`` ignores it)."""
        if head.max_draft_steps is not None and self.depth > head.max_draft_steps:
            raise ValueError(f"tree depth {self.depth} exceeds the head's {head.max_draft_steps} draft steps")
        device = logits.device
        per_depth = [logits[0]]
        dummy = torch.zeros(1, dtype=torch.long, device=device)
        for d in range(2, self.depth + 1):
            logits, state = head.step(cache, state, dummy, d)
            per_depth.append(logits[0])
        per_depth = torch.stack(per_depth)  # [D, V]
        tokens = torch.zeros(self.size, dtype=torch.long, device=device)
        if sampling.temperature <= 0:  # top-k per depth, node = rank of its depth's head
            for d in range(1, self.depth + 1):
                top = torch.topk(per_depth[d - 1], self.max_rank[d - 1]).indices
                nodes = self.nodes_at[d]
                tokens[nodes] = top[self.ranks[nodes]]
            return TreeDraft(tokens, self.parents, self.depths, self.bias, None, "fixed")
        q = sampling.probs(per_depth)  # [D, V]
        draft_probs = torch.cat([q, q.new_zeros(1, q.shape[-1])])[self.depths.clamp(max=self.depth)]  # [N, V]
        parents = torch.tensor(self.parents[1:], device=device)
        # every node draws max_children children without replacement; child m takes its parent's m-th draw
        draws = gumbel_topk(draft_probs.log(), self.max_children, generator)  # [N, C]
        tokens[1:] = draws[parents, self.child_order[1:]]
        return TreeDraft(tokens, self.parents, self.depths, self.bias, draft_probs, "without_replacement")


class DynamicTree:
    """EAGLE-2: grow by expected acceptance (cumulative draft log-probability), verify the best total_tokens."""

    def __init__(self, depth: int = 5, top_k: int = 4, total_tokens: int = 24):
        if total_tokens > top_k + (depth - 1) * top_k * top_k:
            raise ValueError(f"total_tokens={total_tokens} exceeds what depth={depth}, top_k={top_k} can draft")
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.size = total_tokens + 1

    @property
    def scratch(self) -> int:
        """Head cache rows the expansion writes past the committed prefix."""
        return (self.depth - 1) * self.top_k

    def draft(self, head, cache, logits, state, sampling, generator) -> TreeDraft:
        device = logits.device
        K = self.top_k
        h, anchor = state  # ChainHead state: commit's output [1, 1, H] at the anchor position
        logp = logits[0].float().log_softmax(-1)  # EAGLE-2 ranks by the draft's own (T = 1) probabilities
        top = torch.topk(logp, K)
        tokens, scores, parents = [top.indices], [top.values], [torch.full((K,), -1, device=device)]
        frontier = torch.arange(K, device=device)  # candidate ids of the nodes to expand next
        frontier_h = h.expand(1, K, -1)
        fed_slots: list[torch.Tensor] = []  # head cache slot of each expanded candidate, per level
        fed_ids: list[torch.Tensor] = []
        prefix = anchor + 1  # committed head rows 0..anchor
        bias = torch.zeros(K, prefix, device=device, dtype=h.dtype)
        all_tokens, all_scores = tokens[0], scores[0]
        all_parents = parents[0]
        for d in range(1, self.depth):
            slots = torch.arange(prefix + (d - 1) * K, prefix + d * K)  # CPU: no host sync inside the head
            level_bias = torch.full((K, K), float("-inf"), device=device, dtype=h.dtype).fill_diagonal_(0)
            bias = torch.cat([bias, level_bias], dim=1)  # [K, prefix + d*K]
            node_tokens = all_tokens[frontier]
            positions = torch.full((K,), anchor + d, device=device)
            logits_d, out = head.step_tree(cache, frontier_h, node_tokens[None], positions, slots, bias)
            fed_ids.append(frontier)
            child = torch.topk(logits_d.float().log_softmax(-1), K)  # [K, K]
            child_scores = (all_scores[frontier][:, None] + child.values).reshape(-1)  # [K*K]
            base = all_tokens.shape[0]
            all_tokens = torch.cat([all_tokens, child.indices.reshape(-1)])
            all_scores = torch.cat([all_scores, child_scores])
            all_parents = torch.cat([all_parents, frontier.repeat_interleave(K)])
            best = torch.topk(child_scores, K).indices  # next frontier, among the new children
            # the children's mask rows: their parent's row (ancestors + parent itself), then their own slot
            bias = bias[best // K]
            frontier, frontier_h = base + best, out[:, best // K]
        # keep the best total_tokens by cumulative score; a stable sort keeps a parent ahead of an equal child
        order = torch.sort(all_scores, descending=True, stable=True).indices[: self.total_tokens]
        keep = order.sort().values  # candidate order: parents before children
        keep_list, parent_list = torch.stack([keep, all_parents[keep]]).tolist()  # the structure's host sync
        new_index = {c: i + 1 for i, c in enumerate(keep_list)}
        tree_parents = [-1] + [new_index.get(p, 0) if p >= 0 else 0 for p in parent_list]
        tokens = torch.cat([all_tokens.new_zeros(1), all_tokens[keep]])
        depth = [0] * len(tree_parents)
        for i in range(1, len(tree_parents)):
            depth[i] = depth[tree_parents[i]] + 1
        return TreeDraft(tokens, tree_parents, torch.tensor(depth, device=device),
                         tree_attention_bias(tree_parents, torch.float32, device), None, "fixed")


def build_tree(setting: Setting, device) -> StaticTree | DynamicTree | None:
    """The tree a setting names (static: its paths; dynamic: depth, top_k, total_tokens); None for a chain, plain
    decoding or an adaptive setting (whose candidates each name their own)."""
    if setting.kind != "tree" or setting.adaptive:
        return None
    if setting.tree == "static":
        return StaticTree(setting.tree_paths, device)
    return DynamicTree(setting.tree_depth, setting.tree_top_k, setting.tree_total_tokens)


def make_tree(setting: Setting, device) -> StaticTree | DynamicTree | None:
    """build_tree for a setting the user wrote: what does not make a tree is one UserError line."""
    try:
        return build_tree(setting, device)
    except ValueError as e:
        raise UserError(str(e)) from e


# -- expected tokens per target pass (auto selection and the benchmark's prediction) --------------------------

def rank_accept(alphas: list[float], depth: int, rank: int, ranks=None) -> float:
    """P(the rank-r child at ``depth`` is kept | its parent was kept): α_d × how often rank r hits relative to rank 0.

    ``ranks`` (acceptance.json's alpha_rank, T = 0): per depth, P(the target's token is the head's rank-r token),
    measured; used as ratios to rank 0 (non-increasing) so that rank 0 keeps the chain's α_d. Without it a model: each
    rejected sibling leaves the next one the same chance α_d, P(rank r kept) = α_d (1 − α_d)^r (positional acceptance,
    as in Sequoia), which over-predicted a weak EAGLE-3 head's 8-node tree τ by a third
    (docs/results/serving-and-adaptive.md).
    """
    a = alphas[min(depth, len(alphas)) - 1]
    row = ranks[min(depth, len(ranks)) - 1] if ranks else None
    if not row or row[0] <= 0:
        return a * (1 - a) ** rank
    ratio = 1.0
    for r in range(1, min(rank, len(row) - 1) + 1):
        ratio = min(ratio, row[r] / row[0])
    return a * ratio * (1 - a) ** max(0, rank - len(row) + 1)  # past the measured ranks: positional decay


def expected_tau_paths(alphas: list[float], paths, ranks=None) -> float:
    """1 + Σ over nodes of P(node's path is accepted), for a static tree of index paths."""
    total = 1.0
    for p in paths:
        prob = 1.0
        for d, r in enumerate(p, start=1):
            prob *= rank_accept(alphas, d, r, ranks)
        total += prob
    return total


def expected_tau_dynamic(alphas: list[float], depth: int, top_k: int, total_tokens: int, ranks=None) -> float:
    """τ of the best tree of total_tokens nodes (depth ≤ depth, ≤ top_k children), grown best-first."""
    frozen = tuple(map(tuple, ranks)) if ranks else None
    grown = _best_first(tuple(alphas), depth, top_k, max(total_tokens, 64), frozen)
    return grown[min(total_tokens, len(grown) - 1)]


@functools.lru_cache(maxsize=64)
def _best_first(alphas: tuple, depth: int, top_k: int, total_tokens: int, ranks: tuple | None = None) -> list[float]:
    """τ after 0, 1, .., total_tokens best-first nodes: adaptive drafting scores every size of one (depth, top_k)
    each round from one growth. A child is worth at most its parent and a sibling at most its elder, so a popped
    node only has to offer its first child and its next sibling to keep the best remaining node on the heap."""
    rank = [[rank_accept(alphas, d, r, ranks) for r in range(top_k)] for d in range(depth + 1)]  # row 0 unused
    heap = [(-rank[1][0], 1, 0, 1.0)]  # (−value, depth, rank, the parent's value)
    taus = [1.0]
    for _ in range(total_tokens):
        if not heap:
            break
        neg, d, r, parent = heapq.heappop(heap)
        taus.append(taus[-1] - neg)
        if r + 1 < top_k:
            heapq.heappush(heap, (-parent * rank[d][r + 1], d, r + 1, parent))
        if d < depth:
            heapq.heappush(heap, (neg * rank[d + 1][0], d + 1, 0, -neg))
    return taus
