"""Adaptive drafting: re-choose the chain length or tree size every round from the acceptance this request sees.

gamma=auto picks one γ from training-time α. Acceptance varies by text (code and lists are easy, open prose is
hard), so ``Adaptive`` keeps a running acceptance estimate per draft position for the request, starting from the
training α as a prior worth ``prior_weight`` rounds, forgetting old rounds (the prior too) at ``decay`` per round
so a prior far from this text's acceptance fades instead of holding a floor under the estimate, and picks the
γ (0 included) with the best predicted speedup E[γ] / (r(γ + 1) + γ·c) (serve/auto.py's cost model, the same
measured r(n) and c). When plain decoding (γ = 0) wins, speculation is off; after ``probe_every`` plain rounds one
round drafts anyway, so a head that starts paying again (the text became easier) is noticed. Each probe that does
not turn speculation back on doubles the wait for the next (up to ``probe_max``): a weak head's failed probes cost
~4% of plain speed at a fixed 16-round gap (compiled SmolLM2, one noisy measurement), on every request's length.

With ``settings`` the candidates are any of serve/auto.py's (chains, Medusa static-tree cuts, EAGLE-2 dynamic
trees of several depths and sizes; ``settings[0]`` is plain decoding) and each is scored by auto.predict from the
running estimate. A tree round observes, per depth it reached, one trial per sibling tried (in index order, the
order verify tries them) and whether one was kept: hits ÷ trials is the per-sibling rate α_d of the positional
model tree.rank_accept uses, and for a one-child level it is the chain's 0/1 outcome.

The cost model (r(n), c) times the target pass and the draft step alone; the rest of a drafted round (drafting
loop, verify, commits, a dynamic tree's host sync) is Python and small kernels, which on a small target can cost
more than the pass itself. With ``pass_s`` (one target pass in seconds) every round's wall time is observed:
plain rounds give the time of one plain round, drafted rounds their excess over the model's cost in those units,
kept per kind (chain, tree) and added to that kind's cost. The costs belong to the machine, so they persist across
requests. On a GPU a round's time is its host time up to the verdict's sync, plus whatever the previous round
left queued.
Two things keep that unit honest. ``pass_s`` times the bare pass, not a plain round with its sampling and Python (on
the compiled SmolLM2 runner a plain round measured 5-20% more), and a drafted round measured in the wrong unit looks
cheaper or dearer than it is; so the first ``calibrate`` rounds are plain and timed, and one more every
``refresh_every`` drafted rounds follows the machine's load. And a round ``outlier`` times slower than its setting's
expected time (a compile of a new pass shape, a page fault, another job) is not a cost of that setting: it is
dropped, unless the same setting does it again ``outlier_runs`` times in a row. Before both, one compile inside a
timed plain round set the unit to 1.5 s (31x the pass; a replay of bench.py's compiled warm-up), and a compile
inside a drafted round set that kind's excess to 68 passes: whichever came first, the choice froze (drafting at
0.86x plain, or plain for good), since nothing re-timed the other side.

Exactness does not depend on any of this: each round's verification is exact for whatever γ it was given, and γ
is chosen only from rounds already finished.

The observation per reached position is Σ min(p, q) (the chance the rule keeps that draft): at T = 0 it is the
0/1 match, at T > 0 it has far less variance than the 0/1 outcome.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from serve.auto import predict
from serve.setting import Costs, Setting


@dataclass
class Adaptive:
    prior: list[float]  # α per draft position (acceptance.json); its length caps γ
    costs: Costs  # r(n) and c, measured (serve/auto.py measure_costs)
    prior_weight: float = 4.0  # rounds the training α is worth: a few bad rounds can overrule it
    decay: float = 0.9  # per observed round: the estimate follows the last ~10 rounds of this text
    probe_every: int = 16  # plain rounds before the first probe while speculation is off (per request)
    probe_max: int = 128  # the longest wait between probes, after failed ones
    settings: list[Setting] | None = None  # candidates, settings[0] plain decoding; None: chains γ = 0..len(prior)
    pass_s: float | None = None  # one target pass (Costs.pass_s); None: no online cost correction
    calibrate: int = 2  # with pass_s: plain rounds timed before the first drafted one (once per Adaptive)
    refresh_every: int = 64  # drafted rounds in a row before one plain round re-times the unit
    outlier: float = 3.0  # a round this many times its expected time is dropped (a compile, a stall) ...
    outlier_runs: int = 3  # ... unless its setting does it this many times in a row: then it is the real cost
    sums: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    plain_rounds: int = 0
    weights: list[float] = field(default_factory=list)  # the prior's weight per position, fading as it is observed
    overhead: dict[str, float] = field(default_factory=dict)  # per kind: a drafted round's excess cost, measured

    def __post_init__(self):
        if not self.prior:
            raise ValueError("adaptive γ needs a prior α per draft position (acceptance.json)")
        if self.settings is None:
            self.settings = [Setting.chain(g) for g in range(len(self.prior) + 1)]
        if self.settings[0].kind != "plain":
            raise ValueError("adaptive settings must start with plain decoding, Setting.chain(0)")
        self.round_costs = [predict(s, [1.0] * self.positions, self.costs)["cost"] for s in self.settings]  # α-free
        self.round_s = self.pass_s
        self.plain_weight = 0.0  # observed plain rounds behind round_s (decayed); 0: still the pass_s prior
        self.plain_timed = 0  # plain rounds timed so far, for calibrate
        self.drafted_run = 0  # drafted rounds since the last timed plain round, for refresh_every
        self.dropped: dict[int, int] = {}  # per setting: outliers dropped in a row
        self.reset()

    @property
    def positions(self) -> int:
        """Positions the estimate keeps: the prior's, or the deepest candidate's when deeper."""
        return max(len(self.prior), *(s.depth for s in self.settings))

    def reset(self) -> None:
        """A new request: back to the prior."""
        self.sums = [0.0] * self.positions
        self.counts = [0.0] * self.positions
        self.weights = [self.prior_weight] * self.positions
        self.plain_rounds = 0
        self.probe_gap = self.probe_every
        self._scores = None

    def estimate(self) -> list[float]:
        """Running α per position. A position's prior is the training α scaled by how the position before it
        fares against its own training α: positions past the current γ are never observed, and without this a
        head doing better than in training would never be tried deeper."""
        out, scale = [], 1.0
        prior = self.prior + self.prior[-1:] * (self.positions - len(self.prior))  # α_K stands in deeper
        for s, n, w, a in zip(self.sums, self.counts, self.weights, prior):
            base = min(1.0, a * scale)
            out.append((s + w * base) / (n + w) if n + w > 0 else base)
            scale = out[-1] / a if a > 0 else scale  # this position's running α ÷ its training α
        return out

    def speedups(self) -> list[float]:
        """Predicted speedup over plain decoding of each setting (chains: index = γ). Kept until a drafted round
        changes the estimate or the costs: while speculation is off, a plain round costs no re-scoring."""
        if self._scores is None:
            self._scores = self._score()
        return self._scores

    def _score(self) -> list[float]:
        alphas = self.estimate()
        out = [1.0]
        for s, cost in zip(self.settings[1:], self.round_costs[1:]):
            cost += self.overhead.get(s.kind, 0.0)
            out.append(predict(s, alphas, self.costs)["tau_predicted"] / max(cost, 1e-3))
        return out

    def choose(self) -> int:
        """The index in ``settings`` of this round's setting (for the default chains, γ itself)."""
        if self.round_s is not None and (self.plain_timed < self.calibrate or self.drafted_run >= self.refresh_every):
            return 0  # time a plain round: the unit every drafted round is measured in
        pred = self.speedups()
        best = max(range(len(pred)), key=pred.__getitem__)  # ties keep 0: speculation must predict a gain
        if best > 0:
            self.plain_rounds = 0
            self.probe_gap = self.probe_every
            self.drafted_run += 1
            return best
        self.plain_rounds += 1
        if self.plain_rounds >= self.probe_gap:
            self.plain_rounds = 0
            self.probe_gap = min(2 * self.probe_gap, self.probe_max)  # reset above if the probe pays
            return max(range(1, len(pred)), key=pred.__getitem__)
        return 0

    def observe(self, gamma: int, alpha: list[float]) -> None:
        """alpha: Σ min(p, q) at the positions this round reached (the first n_accepted + 1, at most γ)."""
        for i, a in enumerate(alpha[:gamma]):
            self._add(i, a, 1.0)

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
            self._add(d, kept, trials)

    def _add(self, i: int, hits: float, trials: float) -> None:
        self.sums[i] = self.decay * self.sums[i] + hits
        self.counts[i] = self.decay * self.counts[i] + trials
        self.weights[i] *= self.decay
        self._scores = None

    def observe_time(self, index: int, seconds: float) -> None:
        """The wall time of a finished round that used ``settings[index]``."""
        if self.round_s is None:
            return
        k = self.settings[index].kind
        expected = self.round_s * (1.0 if index == 0 else self.round_costs[index] + self.overhead.get(k, 0.0))
        if seconds > self.outlier * expected and self.dropped.get(index, 0) < self.outlier_runs:
            self.dropped[index] = self.dropped.get(index, 0) + 1
            return
        self.dropped[index] = 0
        if index == 0:  # a running mean of the last ~1/(1 - decay) plain rounds; the first replaces pass_s
            self.plain_weight = self.decay * self.plain_weight
            self.round_s = (self.plain_weight * self.round_s + seconds) / (self.plain_weight + 1.0)
            self.plain_weight += 1.0
            self.plain_timed += 1
            self.drafted_run = 0  # the scores stand: costs and excesses are in plain rounds, whatever one takes
            return
        excess = seconds / self.round_s - self.round_costs[index]
        self._scores = None
        self.overhead[k] = excess if k not in self.overhead else self.decay * self.overhead[k] + (1 - self.decay) * excess
