"""What a decode round drafts (``Setting``) and what this machine's passes cost (``Costs``).

A setting is one of three kinds, each with its own excess cost per round (serve/calibrate.py): ``plain`` decoding
(nothing drafted, the head unused), a ``chain`` of γ drafts, or a ``tree`` (``static``: Medusa's index paths;
``dynamic``: EAGLE-2's depth, top_k and total_tokens). An ``adaptive`` setting re-chooses among candidates every
round (serve/adaptive.py). bench.json and the benchmarks' reports write a setting as ``to_json``'s dict:
{"gamma": γ} (plain: γ = 0), a tree's {"tree", "tree_depth", "tree_top_k" | "tree_paths", "tree_total_tokens"},
or {"adaptive": true, "tree"?}.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("plain", "chain", "tree")


@dataclass(frozen=True)
class Setting:
    kind: str  # plain | chain | tree
    gamma: int = 0  # chain: drafts per round
    tree: str | None = None  # static | dynamic (adaptive: the kind of tree its candidates include, or None)
    tree_depth: int | None = None
    tree_top_k: int | None = None  # dynamic: children per expanded node, and nodes expanded per depth
    tree_paths: tuple[tuple[int, ...], ...] | None = None  # static: Medusa index paths
    tree_total_tokens: int | None = None  # drafted nodes
    adaptive: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"setting kind {self.kind!r}; choose one of {', '.join(KINDS)}")

    @classmethod
    def chain(cls, gamma: int) -> Setting:
        """γ drafts per round; γ = 0 is plain decoding."""
        return cls("chain", gamma) if gamma else cls("plain")

    @classmethod
    def static_tree(cls, paths, depth: int | None = None) -> Setting:
        """Medusa index paths; ``depth`` (default: the longest path's) is what the cost model counts head calls by."""
        paths = tuple(tuple(p) for p in paths)
        return cls("tree", tree="static", tree_depth=depth or max(map(len, paths)), tree_paths=paths,
                   tree_total_tokens=len(paths))

    @classmethod
    def dynamic_tree(cls, depth: int, top_k: int, total_tokens: int) -> Setting:
        return cls("tree", tree="dynamic", tree_depth=depth, tree_top_k=top_k, tree_total_tokens=total_tokens)

    @classmethod
    def adaptive_over(cls, tree: str | None) -> Setting:
        """Re-chosen every round among chains (and trees of kind ``tree``), plain decoding included."""
        return cls("tree" if tree else "chain", tree=tree, adaptive=True)

    @property
    def depth(self) -> int:
        """Draft positions a round reaches: γ for a chain, the tree's depth, 0 for plain decoding."""
        return self.tree_depth if self.kind == "tree" and not self.adaptive else self.gamma

    def to_json(self, paths: bool = True) -> dict:
        """The dict bench.json records; ``paths=False`` leaves out a static tree's paths (tables)."""
        if self.adaptive:
            return {"adaptive": True, **({"tree": self.tree} if self.tree else {})}
        if self.kind != "tree":
            return {"gamma": self.gamma}
        out = {"tree": self.tree, "tree_depth": self.tree_depth}
        if self.tree == "dynamic":
            out["tree_top_k"] = self.tree_top_k
        elif paths:
            out["tree_paths"] = [list(p) for p in self.tree_paths]
        return {**out, "tree_total_tokens": self.tree_total_tokens}

    def describe(self) -> str:
        """The setting in a few words (logs, bench tables)."""
        if self.adaptive:
            return f"adaptive {self.tree} tree" if self.tree else "adaptive γ"
        if self.kind != "tree":
            return f"chain γ={self.gamma}" if self.gamma else "plain"
        if self.tree == "static":
            return f"static tree {self.tree_total_tokens} nodes, depth {self.tree_depth}"
        return f"dynamic tree {self.tree_total_tokens} nodes, depth {self.tree_depth}, top-{self.tree_top_k}"


@dataclass
class Costs:
    """This machine's costs in units of one target pass over one token (serve/auto.py measure_costs)."""

    pass_ratios: dict[int, float]  # r(n): a target pass over n tokens ÷ one over 1 token, at the measured n (r(1) = 1)
    draft_step: float | None = None  # c: one draft step ÷ one target pass over 1 token; None: measured without a head
    pass_s: float | None = None  # seconds of one target pass over 1 token: the unit
    draft_step_s: float | None = None
    context: int | None = None  # cached tokens the passes ran after

    def target_pass(self, n: int) -> float:
        """r(n) from the measured points (linear between them, flat-slope extrapolation past the last)."""
        r = self.pass_ratios
        xs = sorted(r)
        if n in r:
            return r[n]
        lo = max([x for x in xs if x < n], default=xs[0])
        hi = min([x for x in xs if x > n], default=None)
        if hi is None:
            prev = max([x for x in xs if x < lo], default=lo)
            slope = (r[lo] - r[prev]) / (lo - prev) if lo != prev else 0.0
            return r[lo] + slope * (n - lo)
        return r[lo] + (r[hi] - r[lo]) * (n - lo) / (hi - lo)

    def round_cost(self, n: int, draft_calls: int) -> float:
        """A round's passes: one target pass over n tokens and ``draft_calls`` draft steps."""
        return self.target_pass(n) + draft_calls * self.draft_step

    def in_passes(self, seconds: float) -> float:
        return seconds / self.pass_s

    def to_json(self) -> dict:
        """The dict bench.json and the benchmarks record: target_pass_1_s, r, context, and with a head draft_step_s
        and c."""
        out = {"target_pass_1_s": self.pass_s, "r": self.pass_ratios, "context": self.context}
        if self.draft_step is not None:
            out.update(draft_step_s=self.draft_step_s, c=self.draft_step)
        return out
