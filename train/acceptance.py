"""Acceptance α of draft heads on held-out data, ``acceptance.json``, and the α-per-position plot.

For each held-out position t and draft step k, α_k = Σ_x min(p_k(x), q_k(x)) with p_k the target's and q_k the
head's distribution after the same temperature/top-k/top-p processing (heads.losses.alpha_sums); earlier draft
steps see the held-out tokens, i.e. the path along which every earlier draft was accepted. Sums and token counts
are aggregated exactly over all held-out tokens, then divided once. Several heads (trained, untrained) share one
target forward per batch.

τ is predicted by walking the speculative chain over the held-out text (``chain_rounds``): a round at anchor t
emits the target's token plus the run of accepted drafts, P(run ≥ j) = Π_{i≤j} α_i(t) with α_i(t) the acceptance
of step i at that very anchor, and the next round starts where the run ends. On the target's greedy text at T = 0
this is exactly what a greedy runner does; the product of *mean* α per step (heads.losses.tau_predicted) ignores
that hard contexts reject every step together and overestimates τ. ``alpha_chain`` is the conditional rate
P(step k accepted | steps < k accepted), whose running product does give the chain's mean run.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from heads.base import DraftHead
from heads.losses import alpha, scored_logits, tau_predicted
from heads.sampling import probs_from_logits
from heads.target import Target


RANKS = 4  # draft ranks whose greedy hit rate is recorded: the top-k a dynamic tree expands (serve/auto.py: 4)


@torch.no_grad()
def acceptance_grid(head: DraftHead, out, feats, temperature: float, top_k: int, top_p: float,
                    hits: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, K]: α of draft step k at anchor t (Σ min(p, q); 0/1 at T = 0); 0 where the predicted token is not
    trained. ``hits`` [K, RANKS], if given, gains per step the anchors where the target's greedy token is the head's
    rank-r token, from the same logits: a greedy tree's rank-r child is kept exactly then, where tree.rank_accept
    otherwise guesses α_d (1 − α_d)^r, which over-predicted a weak head's 8-node tree τ by a third
    (docs/results/serving-and-adaptive.md)."""
    if feats.logit_columns is not None:
        raise ValueError("α needs the target's logits over its whole vocabulary; compute features without columns=")
    B, T = feats.loss_mask.shape
    grid = torch.zeros((B, T, len(out.states)), dtype=torch.float64)
    # Draft logits stay on the draft vocabulary: q is zero outside it, so α only needs p on its columns, and an
    # argmax or top-k there read through ``cols`` is the target-vocabulary one. Scattering [N, 49k] -inf rows per
    # step was ~40% of a held-out check. The target's rows are processed once: step k's are a subset.
    cols = head.draft_token_ids(feats.loss_mask.device)  # [V_draft] target ids
    position = feats.loss_mask.nonzero()[:, 1]  # [N] each scored row's position, in scored_logits' row order
    scored = feats.scored_target_logits()  # [N, V]
    best = scored.argmax(-1) if temperature <= 0 or hits is not None else None
    if temperature > 0:
        p = probs_from_logits(scored, temperature, top_k, top_p).index_select(-1, cols)  # [N, V_draft]
    for k in range(1, len(out.states) + 1):
        rows = position >= k
        draft = scored_logits(out, feats.loss_mask, k)  # [N_k, V_draft], scored anchors only
        if temperature <= 0:  # one-hot argmaxes: Σ min(p, q) is 1 exactly where they agree
            a = (cols[draft.argmax(-1)] == best[rows]).float()
        else:
            a = alpha(p[rows], probs_from_logits(draft, temperature, top_k, top_p))
        step = grid[:, :T - k, k - 1]  # a view: anchor t, step k predicts the token after t + k
        step[feats.loss_mask[:, k:].cpu()] = a.double().cpu()
        if hits is not None:
            hits[k - 1] += (cols[draft.topk(RANKS, -1).indices] == best[rows, None]).sum(0).double().cpu()
    return grid


def decoding(mask: np.ndarray) -> np.ndarray:
    """Anchors a runner decodes from: the span's last anchor is never one (its token ends the answer), and the
    span's first token comes from prefill, so Σ active = the tokens rounds emit (serve/'s τ numerator)."""
    return mask & np.concatenate([mask[:, 1:], np.zeros((mask.shape[0], 1), bool)], 1)


def chain_rounds(grid: np.ndarray, mask: np.ndarray, gamma: int) -> float:
    """Expected target passes of a γ-chain over every answer span (contiguous ``mask`` runs) of the batch."""
    B, T, _ = grid.shape
    at_least = np.concatenate([np.ones((B, T, 1)), np.cumprod(grid[..., :gamma], -1)], -1)  # P(run ≥ j), j=0..γ
    exactly = at_least - np.concatenate([at_least[..., 1:], np.zeros((B, T, 1))], -1)  # P(run = j)
    starts = mask & ~np.concatenate([np.zeros((B, 1), bool), mask[:, :-1]], 1)
    active = decoding(mask)
    mass = np.zeros((B, T + gamma + 2))  # probability that a round starts at anchor t
    rounds = 0.0
    for t in range(T):
        mass[:, t] = np.where(active[:, t], mass[:, t] + starts[:, t], 0.0)
        rounds += mass[:, t].sum()
        mass[:, t + 1:t + gamma + 2] += mass[:, t, None] * exactly[:, t]
    return rounds


class Tally:
    """Exact sums over held-out anchors (per step: Σ α, count, Σ Π_{i≤k} α_i; per γ: rounds), divided once."""

    def __init__(self, K: int):
        self.sums, self.counts, self.prods, self.rounds = (np.zeros(K) for _ in range(4))
        self.ranks = np.zeros((K, RANKS))  # acceptance_grid's hits, summed (greedy measurements only)
        self.tokens = self.anchors = 0

    def add(self, grid: torch.Tensor, loss_mask: torch.Tensor) -> None:
        g, m = grid.numpy(), loss_mask.cpu().numpy().astype(bool)
        K, T = g.shape[-1], m.shape[1]
        for k in range(1, K + 1):
            self.sums[k - 1] += g[:, :T - k, k - 1][m[:, k:]].sum()
            self.counts[k - 1] += m[:, k:].sum()
        self.prods += np.cumprod(g, -1)[m].sum(0)
        self.rounds += [chain_rounds(g, m, gamma) for gamma in range(1, K + 1)]
        self.tokens += int(decoding(m).sum())
        self.anchors += int(m.sum())

    def merge(self, other: "Tally") -> None:
        for name in ("sums", "counts", "prods", "rounds", "ranks"):
            getattr(self, name).__iadd__(getattr(other, name))
        self.tokens += other.tokens
        self.anchors += other.anchors

    def to_tensor(self) -> torch.Tensor:
        """[(4 + RANKS)K + 2] float64: every sum in one tensor, for one all-reduce over ranks."""
        return torch.from_numpy(np.concatenate([self.sums, self.counts, self.prods, self.rounds,
                                                self.ranks.ravel(), [self.tokens, self.anchors]]))

    @classmethod
    def from_tensor(cls, flat: torch.Tensor) -> "Tally":
        flat = flat.double().cpu().numpy()
        K = (len(flat) - 2) // (4 + RANKS)
        tally = cls(K)
        tally.sums, tally.counts, tally.prods, tally.rounds = (flat[i * K:(i + 1) * K].copy() for i in range(4))
        tally.ranks = flat[4 * K:(4 + RANKS) * K].reshape(K, RANKS).copy()
        tally.tokens, tally.anchors = int(flat[-2]), int(flat[-1])
        return tally

    def summary(self) -> dict:
        chain = np.concatenate([[self.anchors], self.prods])  # Σ P(run ≥ k), k = 0..K
        out = {"alpha": [s / c if c else 0.0 for s, c in zip(self.sums, self.counts)],
               "num_tokens": [int(c) for c in self.counts],
               "alpha_chain": [float(b / a) if a else 0.0 for a, b in zip(chain[:-1], chain[1:])],
               "tau_predicted": {g: float(self.tokens / r) if r else 1.0 for g, r in enumerate(self.rounds, start=1)}}
        if self.ranks.any():  # P(the target's greedy token is the head's rank-r token), per step
            out["alpha_rank"] = [[float(h / c) if c else 0.0 for h in row] for row, c in zip(self.ranks, self.counts)]
        return out


@torch.no_grad()
def measure(heads: dict[str, DraftHead], target: Target, loader, temperatures, top_k: int = 0,
            top_p: float = 1.0, raw: bool = False) -> dict[str, dict[float, dict]]:
    """-> {head name: {temperature: {"alpha", "num_tokens", "alpha_chain", "tau_predicted"}}} (``raw``: Tally)."""
    device = next(target.model.parameters()).device
    layers = sorted({k for h in heads.values() for k in h.feature_layers})
    tallies = {(n, t): Tally(h.num_steps) for n, h in heads.items() for t in temperatures}
    for head in heads.values():
        head.eval().to(device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items() if not k.startswith("hidden.")}  # the target's own pass
        attn = None if bool(batch["attention_mask"].all()) else batch["attention_mask"]
        feats = target.features(batch["input_ids"], batch["loss_mask"], attn, layers=layers)
        for name, head in heads.items():
            out = head(feats.hidden_as(next(head.parameters()).dtype))  # a bf16 target's features, an fp32 head
            for t in temperatures:
                hits = torch.zeros((head.num_steps, RANKS), dtype=torch.float64) if t == 0 else None  # greedy trees
                tallies[name, t].add(acceptance_grid(head, out, feats, t, top_k, top_p, hits), batch["loss_mask"])
                if hits is not None:
                    tallies[name, t].ranks += hits.numpy()
    return {n: {t: tallies[n, t] if raw else tallies[n, t].summary() for t in temperatures} for n in heads}


def measure_sets(heads: dict[str, DraftHead], target: Target, sets: dict, top_k: int = 0, top_p: float = 1.0) -> dict:
    """sets = {temperature: {category: loader}}: each temperature on its own text -> measure()'s result, plus
    "by_category" {category: summary} when the held-out data has more than one category."""
    result: dict[str, dict[float, dict]] = {n: {} for n in heads}
    for t, loaders in sets.items():
        total = {n: Tally(h.num_steps) for n, h in heads.items()}
        by_category: dict[str, dict] = {n: {} for n in heads}
        for category, loader in loaders.items():
            raw = measure(heads, target, loader, [t], top_k, top_p, raw=True)
            for n in heads:
                total[n].merge(raw[n][t])
                by_category[n][str(category)] = raw[n][t].summary()
        for n in heads:
            result[n][t] = total[n].summary()
            if len(loaders) > 1:
                result[n][t]["by_category"] = by_category[n]
    return result


def add_vocab_coverage(record: dict, head: DraftHead, eval_sets: dict) -> None:
    """record (and its "test") gains draft_vocab_coverage {temperature: share of that split's held-out answer tokens
    inside the head's draft vocabulary}; nothing for a head drafting the whole vocabulary. A draft never proposes a
    token outside it, so the share caps α at every step (at T > 0 in expectation, on the sampled text). EAGLE-3's
    8,192 tokens covered 92% of the SmolLM2 recipe's greedy answers (2026-12-07)."""
    cols = head.draft_token_ids()
    if len(cols) >= head.dims.vocab_size:
        return
    inside = torch.zeros(head.dims.vocab_size, dtype=torch.bool)
    inside[cols.cpu()] = True
    for split, into in (("validation", record), ("test", record.get("test"))):
        shares = {}
        for t, examples in eval_sets.items():
            # loss_mask[t]: position t predicts token t + 1, an answer token
            nxt = [ex.input_ids[1:][ex.loss_mask[:-1]] for ex in examples if ex.split == split]
            if nxt:
                shares[str(t)] = float(inside[torch.cat(nxt)].double().mean())
        if into is not None and shares:
            into["draft_vocab_coverage"] = shares


def acceptance_record(head_name: str, target_name: str, data: str, temperature: float, measured: dict,
                      untrained: dict | None = None, top_k: int = 0, top_p: float = 1.0,
                      texts: dict | None = None) -> dict:
    """The acceptance.json schema: measured = {temperature: measure()'s summary} for one head; ``texts``
    {temperature: which held-out text that temperature's α was measured on}."""
    main = measured[temperature]
    record = {
        "head": head_name, "target": target_name, "data": data, "temperature": temperature, "top_k": top_k,
        "top_p": top_p, "alpha": main["alpha"], "alpha_chain": main["alpha_chain"],
        "tau_predicted": main["tau_predicted"], "tau_product_of_alpha": tau_predicted(main["alpha"]),
        "num_tokens": main["num_tokens"][0], "num_tokens_per_step": main["num_tokens"],
        "alpha_by_temperature": {str(t): m["alpha"] for t, m in measured.items()},
        "alpha_chain_by_temperature": {str(t): m["alpha_chain"] for t, m in measured.items()},
        "tau_predicted_by_temperature": {str(t): m["tau_predicted"] for t, m in measured.items()},
    }
    ranks = {str(t): m["alpha_rank"] for t, m in measured.items() if "alpha_rank" in m}
    if ranks:
        record["alpha_rank_by_temperature"] = ranks
    if texts:
        record["text_by_temperature"] = {str(t): texts[t] for t in measured if t in texts}
    if "by_category" in main:
        record["alpha_by_category"] = {c: m["alpha"] for c, m in main["by_category"].items()}
        record["tau_predicted_by_category"] = {c: m["tau_predicted"] for c, m in main["by_category"].items()}
        record["num_tokens_by_category"] = {c: m["num_tokens"][0] for c, m in main["by_category"].items()}
    if untrained is not None:
        record["alpha_untrained"] = untrained[temperature]["alpha"]
        record["alpha_untrained_by_temperature"] = {str(t): m["alpha"] for t, m in untrained.items()}
    return record


TEST_FIELDS = ("alpha", "alpha_chain", "tau_predicted", "num_tokens", "num_tokens_per_step", "alpha_by_temperature",
               "tau_predicted_by_temperature", "alpha_by_category", "tau_predicted_by_category",
               "num_tokens_by_category", "text_by_temperature")


def with_test_split(record: dict, measured_test: dict, prompt_keys: dict[str, list[str]]) -> dict:
    """acceptance.json's top level holds the validation split (what picked the head, what gamma=auto and the
    benchmarks' predictions read); "test" holds the same figures on the test split, which nothing was chosen or
    tuned on: the numbers to report. ``prompt_keys``: {split: heads.splits.prompt_key of each held-out prompt}, so
    a benchmark can refuse prompts the head's α was measured on."""
    test = acceptance_record(record["head"], record["target"], record["data"], record["temperature"], measured_test,
                             top_k=record["top_k"], top_p=record["top_p"])
    record["split"] = "validation"
    record["test"] = {k: test[k] for k in TEST_FIELDS if k in test}
    record["heldout_prompt_keys"] = prompt_keys
    return record


def write_json(path: Path, obj: dict) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)  # atomic: readers never see half a file


def plot_alpha(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    ks = list(range(1, len(record["alpha"]) + 1))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(ks, record["alpha"], "o-", label="trained, validation" if "test" in record else "trained")
    if "test" in record:
        ax.plot(ks, record["test"]["alpha"], "^-", label="trained, test")
    if "alpha_untrained" in record:
        ax.plot(ks, record["alpha_untrained"], "s--", label="untrained")
    ax.set_xlabel("draft position k")
    ax.set_ylabel(f"α_k (temperature {record['temperature']})")
    ax.set_ylim(0, 1)
    ax.set_xticks(ks)
    ax.set_title(f"{record['head']} on {record['target']}: {record['num_tokens']} held-out tokens", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
