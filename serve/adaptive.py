"""Adaptive drafting: re-choose the chain length or tree size every round from the acceptance this request sees.

gamma=auto picks one γ from training-time α. Acceptance varies by text (code and lists are easy, open prose is
hard), so ``Adaptive`` keeps a running acceptance estimate per draft position for the request, starting from the
training α as a prior worth ``prior_weight`` rounds and forgetting old rounds at ``decay`` per round, and picks the
γ (0 included) with the best predicted speedup E[γ] / (r(γ + 1) + γ·c) (serve/auto.py's cost model, the same
measured r(n) and c). When plain decoding (γ = 0) wins, speculation is off; every ``probe_every`` plain rounds one
round drafts anyway, so a head that starts paying again (the text became easier) is noticed.

With ``settings`` the candidates are any of serve/auto.py's (chains, Medusa static-tree cuts, EAGLE-2 dynamic
trees of several depths and sizes; ``settings[0]`` is plain decoding) and each is scored by auto.predict from the
running estimate. A tree round observes, per depth it reached, one trial per sibling tried (in index order, the
order verify tries them) and whether one was kept: hits ÷ trials is the per-sibling rate α_d of the positional
model tree.rank_accept uses, and for a one-child level it is the chain's 0/1 outcome.

Exactness does not depend on any of this: each round's verification is exact for whatever γ it was given, and γ
is chosen only from rounds already finished.

The observation per reached position is Σ min(p, q) (the chance the rule keeps that draft): at T = 0 it is the
0/1 match, at T > 0 it has far less variance than the 0/1 outcome.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from serve.auto import predict


@dataclass
class Adaptive:
    prior: list[float]  # α per draft position (acceptance.json); its length caps γ
    r: dict[int, float]  # r(n): a target pass over n tokens ÷ one token (serve/auto.py measure_costs)
    c: float  # one draft step ÷ one target token
    prior_weight: float = 4.0  # rounds the training α is worth: a few bad rounds can overrule it
    decay: float = 0.9  # per observed round: the estimate follows the last ~10 rounds of this text
    probe_every: int = 16  # plain rounds between probes while speculation is off
    settings: list[dict] | None = None  # candidates, settings[0] = {"gamma": 0}; None: chains γ = 0..len(prior)
    sums: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    plain_rounds: int = 0

    def __post_init__(self):
        if not self.prior:
            raise ValueError("adaptive γ needs a prior α per draft position (acceptance.json)")
        if self.settings is None:
            self.settings = [{"gamma": g} for g in range(len(self.prior) + 1)]
        if self.settings[0] != {"gamma": 0}:
            raise ValueError("adaptive settings must start with plain decoding, {'gamma': 0}")
        self.reset()

    @property
    def positions(self) -> int:
        """Positions the estimate keeps: the prior's, or the deepest candidate's when deeper."""
        return max(len(self.prior), *(s.get("gamma") or s.get("tree_depth", 0) for s in self.settings))

    def reset(self) -> None:
        """A new request: back to the prior."""
        self.sums = [0.0] * self.positions
        self.counts = [0.0] * self.positions
        self.plain_rounds = 0

    def estimate(self) -> list[float]:
        """Running α per position. A position's prior is the training α scaled by how the position before it
        fares against its own training α: positions past the current γ are never observed, and without this a
        head doing better than in training would never be tried deeper."""
        out, scale = [], 1.0
        prior = self.prior + self.prior[-1:] * (self.positions - len(self.prior))  # α_K stands in deeper
        for s, n, a in zip(self.sums, self.counts, prior):
            base = min(1.0, a * scale)
            out.append((s + self.prior_weight * base) / (n + self.prior_weight))
            scale = out[-1] / a if a > 0 else scale  # this position's running α ÷ its training α
        return out

    def speedups(self) -> list[float]:
        """Predicted speedup over plain decoding of each setting (chains: index = γ)."""
        alphas = self.estimate()
        return [predict(s, alphas, self.r, self.c)["speedup_predicted"] for s in self.settings]

    def choose(self) -> int:
        """The index in ``settings`` of this round's setting (for the default chains, γ itself)."""
        pred = self.speedups()
        best = max(range(len(pred)), key=pred.__getitem__)  # ties keep 0: speculation must predict a gain
        if best > 0:
            self.plain_rounds = 0
            return best
        self.plain_rounds += 1
        if self.plain_rounds >= self.probe_every:
            self.plain_rounds = 0
            return max(range(1, len(pred)), key=pred.__getitem__)
        return 0

    def observe(self, gamma: int, alpha: list[float]) -> None:
        """alpha: Σ min(p, q) at the positions this round reached (the first n_accepted + 1, at most γ)."""
        for i, a in enumerate(alpha[:gamma]):
            self.sums[i] = self.decay * self.sums[i] + a
            self.counts[i] = self.decay * self.counts[i] + 1.0

    def observe_tree(self, parents: list[int], path: list[int]) -> None:
        """A tree round: ``parents`` of its nodes, ``path`` the kept nodes from the root (path[0] = 0)."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents[1:], start=1):
            children.setdefault(p, []).append(i)
        for d, node in enumerate(path[: self.positions]):
            kids = children.get(node)
            if not kids:
                break
            kept = d + 1 < len(path)
            trials = kids.index(path[d + 1]) + 1 if kept else len(kids)
            self.sums[d] = self.decay * self.sums[d] + kept
            self.counts[d] = self.decay * self.counts[d] + trials
