"""Adaptive γ: re-choose the chain length every round from the acceptance this request actually sees.

gamma=auto picks one γ from training-time α. Acceptance varies by text (code and lists are easy, open prose is
hard), so ``Adaptive`` keeps a running acceptance estimate per draft position for the request, starting from the
training α as a prior worth ``prior_weight`` rounds and forgetting old rounds at ``decay`` per round, and picks the
γ (0 included) with the best predicted speedup E[γ] / (r(γ + 1) + γ·c) (serve/auto.py's cost model, the same
measured r(n) and c). When plain decoding (γ = 0) wins, speculation is off; every ``probe_every`` plain rounds one
round drafts anyway, so a head that starts paying again (the text became easier) is noticed.

Exactness does not depend on any of this: each round's verification is exact for whatever γ it was given, and γ
is chosen only from rounds already finished.

The observation per reached position is Σ min(p, q) (the chance the rule keeps that draft): at T = 0 it is the
0/1 match, at T > 0 it has far less variance than the 0/1 outcome.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from heads.losses import tau_predicted
from serve.auto import interpolate


@dataclass
class Adaptive:
    prior: list[float]  # α per draft position (acceptance.json); its length caps γ
    r: dict[int, float]  # r(n): a target pass over n tokens ÷ one token (serve/auto.py measure_costs)
    c: float  # one draft step ÷ one target token
    prior_weight: float = 4.0  # rounds the training α is worth: a few bad rounds can overrule it
    decay: float = 0.9  # per observed round: the estimate follows the last ~10 rounds of this text
    probe_every: int = 16  # plain rounds between probes while speculation is off
    sums: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    plain_rounds: int = 0

    def __post_init__(self):
        if not self.prior:
            raise ValueError("adaptive γ needs a prior α per draft position (acceptance.json)")
        self.reset()

    @property
    def max_gamma(self) -> int:
        return len(self.prior)

    def reset(self) -> None:
        """A new request: back to the prior."""
        self.sums = [0.0] * self.max_gamma
        self.counts = [0.0] * self.max_gamma
        self.plain_rounds = 0

    def estimate(self) -> list[float]:
        """Running α per position. A position's prior is the training α scaled by how the position before it
        fares against its own training α: positions past the current γ are never observed, and without this a
        head doing better than in training would never be tried deeper."""
        out, scale = [], 1.0
        for s, n, a in zip(self.sums, self.counts, self.prior):
            base = min(1.0, a * scale)
            out.append((s + self.prior_weight * base) / (n + self.prior_weight))
            scale = out[-1] / a if a > 0 else scale  # this position's running α ÷ its training α
        return out

    def speedups(self) -> list[float]:
        """Predicted speedup over plain decoding for γ = 0 .. max_gamma."""
        tau = tau_predicted(self.estimate())
        return [1.0] + [tau[g] / (interpolate(self.r, g + 1) + g * self.c) for g in range(1, self.max_gamma + 1)]

    def choose(self) -> int:
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
