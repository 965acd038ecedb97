"""The decode loop: prefill, then rounds of draft -> verify -> accept, for one sequence at a time.

gpt-fast's speculative loop, with any draft head behind heads.base's drafting contract. Vanilla decoding is the
same loop with nothing drafted (the verify step then samples one token from the target), so it is the fair
baseline. A round of chain speculation with γ:

- draft: the head proposes d_1..d_γ from q_1..q_γ (commit's logits, then γ−1 ``step`` calls);
- verify: one target pass over [next, d_1..d_γ] gives p_1..p_{γ+1}; serve/verify.py keeps a prefix of the drafts
  and draws one more token, so the emitted tokens follow p exactly (greedy: keep while d_i = argmax p_i);
- accept: the target cache keeps the accepted rows (the rest are overwritten next round: rollback is a shorter
  length), the head commits the accepted positions' target features.

Trees (serve/tree.py) go through the same three phases: the pass covers every node under a tree mask and the
accepted path's cache rows are gathered into consecutive slots. p and q always go through the same
temperature / top-k / top-p (heads.sampling). Host syncs per round: one (the verdict), plus one for a dynamic
tree's shape.

With ``adaptive`` (serve/adaptive.py) the round's setting (chain γ, or a tree among the adaptive's candidates) is
re-chosen before every round from the acceptance seen so far; a round with γ = 0 is plain decoding and skips the
head entirely: its target features wait in a backlog that the head commits in one call when speculation resumes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from heads.sampling import probs_from_logits
from serve.adaptive import Adaptive
from serve.tree import DynamicTree, StaticTree, TreeDraft, build_tree
from serve.verify import sample, verify_chain_batched, verify_tree_batched


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, probs: torch.Tensor, generator) -> torch.Tensor:
        return probs.argmax(-1) if self.temperature <= 0 else sample(probs, generator)


@dataclass
class Stats:
    """Counts over rounds; ``summary`` turns them into rates. Position i is draft step i+1 (tree depth i+1)."""

    new_tokens: int = 0  # tokens returned (after stop / max_new_tokens truncation)
    emitted: int = 0  # tokens the decode rounds produced (τ's numerator)
    target_passes: int = 0  # decode rounds; prefill passes are counted apart
    prefills: int = 0
    seconds: float = 0.0
    reached: list[int] = field(default_factory=list)  # rounds in which position i was verified on real context
    accepted: list[int] = field(default_factory=list)  # ... and kept
    alpha_sum: list[float] = field(default_factory=list)  # Σ min(p, q) at reached positions (chain)
    accept_hist: list[int] = field(default_factory=list)  # rounds that kept a drafts, a = 0, 1, ...
    depth_hist: list[int] = field(default_factory=list)  # rounds that drafted d deep (chain: γ = d), d = 0, 1, ...

    def add_round(self, n_accepted: int, depth: int, alpha: list[float] = ()) -> None:
        for lst, size in ((self.reached, depth), (self.accepted, depth), (self.alpha_sum, depth),
                          (self.accept_hist, depth + 1), (self.depth_hist, depth + 1)):
            lst.extend([0] * (size - len(lst)))
        for i in range(min(n_accepted + 1, depth)):
            self.reached[i] += 1
        for i in range(n_accepted):
            self.accepted[i] += 1
        for i, a in enumerate(alpha[: n_accepted + 1]):
            self.alpha_sum[i] += a
        self.accept_hist[n_accepted] += 1
        self.depth_hist[depth] += 1
        self.target_passes += 1
        self.emitted += n_accepted + 1

    def merge(self, other: "Stats") -> None:
        for name in ("new_tokens", "emitted", "target_passes", "prefills", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("reached", "accepted", "alpha_sum", "accept_hist", "depth_hist"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def summary(self) -> dict:
        rate = [a / r if r else None for a, r in zip(self.accepted, self.reached)]
        alpha = [s / r if r else None for s, r in zip(self.alpha_sum, self.reached)]
        return {
            "new_tokens": self.new_tokens, "seconds": self.seconds,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else 0.0,
            "tau_measured": self.emitted / self.target_passes if self.target_passes else 0.0,
            "target_passes": self.target_passes, "prefill_passes": self.prefills,
            "accept_rate_per_position": rate, "alpha_per_position": alpha if any(self.alpha_sum) else None,
            "reached_per_position": self.reached, "accepted_per_position": self.accepted,
            "accept_length_hist": self.accept_hist, "rounds_per_draft_depth": self.depth_hist,
        }


@dataclass
class Decoder:
    """One sequence's decode state: target cache length, the pending token, the head's cache and state."""

    model: torch.nn.Module  # serve.model.Transformer
    head: torch.nn.Module | None = None
    sampling: Sampling = field(default_factory=Sampling)
    gamma: int = 0  # chain drafts per round (0: vanilla)
    tree: StaticTree | DynamicTree | None = None
    seed: int = 0
    adaptive: Adaptive | None = None  # re-choose the setting every round; gamma and tree are then its latest choice
    # per-sequence state, set by prefill
    length: int = 0  # target cache rows that hold accepted tokens
    next_token: torch.Tensor | None = None  # [1] the last emitted token, not yet in the target cache
    head_cache: object = None
    head_logits: torch.Tensor | None = None  # [1, V] draft step 1 at the anchor
    head_state: object = None
    round_alpha: list[float] = field(default_factory=list)  # Σ min(p, q) per drafted position, this round
    backlog: list = field(default_factory=list)  # (hidden, tokens, start) of plain rounds the head has not seen
    round_tree: tuple = ()  # (parents, kept path) of this round's tree, for adaptive's observation
    trace: list[int] = field(default_factory=list)  # adaptive: index of each round's setting, this request
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self):
        self.generator = torch.Generator(self.model.device).manual_seed(self.seed)
        self.layers = tuple(self.head.feature_layers) if self.head is not None else ()
        if self.head is None and (self.gamma or self.tree or self.adaptive):
            raise ValueError("gamma > 0, a tree or adaptive drafting needs a draft head (head_path=...)")
        if self.adaptive is not None and self.tree is not None:
            raise ValueError("adaptive drafting picks its own chain or tree each round: pass tree=None")
        # one tree object per adaptive setting (None for chains), built once: static trees hold device tensors
        self.trees = ([build_tree(s, self.model.device) for s in self.adaptive.settings] if self.adaptive
                      else [self.tree])
        for tree in self.trees:
            if isinstance(tree, DynamicTree) and not hasattr(self.head, "step_tree"):
                raise ValueError(f"a dynamic tree needs a head with step_tree (eagle, eagle3), not {self.head.family}")
            if isinstance(tree, StaticTree) and self.head.family != "medusa":
                raise ValueError(f"static trees draft each depth independently (Medusa); not for {self.head.family}")
        steps = self.head.max_draft_steps if self.head is not None else None
        top = max(self.gammas + [t.depth for t in self.trees if isinstance(t, StaticTree)])
        if steps is not None and top > steps:
            raise ValueError(f"gamma={top} exceeds the {self.head.family} head's {steps} draft steps")

    @property
    def gammas(self) -> list[int]:
        """The chain lengths a round may draft: adaptive's candidates' (0 for trees and plain), else gamma."""
        return [s.gamma for s in self.adaptive.settings] if self.adaptive is not None else [self.gamma]

    @property
    def draft_width(self) -> int:
        """Slots past the sequence a round may write (target and head caches)."""
        return max(self.gammas + [t.size for t in self.trees if t is not None]) + 1

    @property
    def scratch(self) -> int:
        """Head cache rows a dynamic tree's expansion writes past the committed prefix."""
        return max([t.scratch for t in self.trees if isinstance(t, DynamicTree)], default=0)


# -- phases ----------------------------------------------------------------------------------------------------

def prefill(dec: Decoder, prompt: torch.Tensor, max_new_tokens: int) -> int:
    """Run the prompt [P] through the target, emit its first token, and commit the prompt to the head."""
    P = prompt.shape[0]
    width = P + max_new_tokens + dec.draft_width + 1
    dec.model.setup_cache(width)
    logits, hidden = dec.model(prompt[None], 0, hidden_layers=dec.layers, last_only=True)
    first = dec.sampling.draw(dec.sampling.probs(logits), dec.generator)  # [1]
    dec.length, dec.next_token = P, first
    dec.stats.prefills += 1
    if dec.head is not None:
        dec.head_cache = dec.head.new_cache(width + dec.scratch, dec.model.device, dec.model.dtype)
        next_tokens = torch.cat([prompt[1:], first])[None]  # [1, P]: the token after each prompt position
        dec.head_logits, dec.head_state = dec.head.commit(dec.head_cache, hidden, next_tokens, 0)
    return int(first)


def draft(dec: Decoder):
    """Chain: (tokens [γ], draft_probs [γ, V], or None when greedy). Tree: a TreeDraft. Vanilla: empty chain."""
    if dec.tree is not None:
        return dec.tree.draft(dec.head, dec.head_cache, dec.head_logits, dec.head_state, dec.sampling, dec.generator)
    V = dec.model.config.vocab_size
    device = dec.model.device
    greedy = dec.sampling.temperature <= 0
    if dec.gamma == 0:
        return torch.zeros(0, dtype=torch.long, device=device), None if greedy else torch.zeros(0, V, device=device)
    logits, state = dec.head_logits, dec.head_state
    tokens, probs = [], []
    for i in range(1, dec.gamma + 1):
        if greedy:  # the argmax itself: its one-hot q would only be compared with the target's argmax
            tokens.append(logits.argmax(-1))
        else:
            q = dec.sampling.probs(logits)  # [1, V]
            tokens.append(dec.sampling.draw(q, dec.generator))
            probs.append(q)
        if i < dec.gamma:
            logits, state = dec.head.step(dec.head_cache, state, tokens[-1], i + 1)
    return torch.cat(tokens), None if greedy else torch.cat(probs)


def verify(dec: Decoder, drafted):
    """One target pass over the pending token and the drafts -> (verdict on the host, target hidden rows).

    verdict: (path or None, emitted tokens) as host lists; path lists the tree nodes kept (chain: implicit).
    """
    if isinstance(drafted, TreeDraft):
        tokens = drafted.tokens.clone()
        tokens[0] = dec.next_token[0]
        logits, hidden = dec.model(tokens[None], dec.length, positions=dec.length + drafted.depths,
                                   tree_bias=drafted.bias, hidden_layers=dec.layers)
        target_probs = dec.sampling.probs(logits)  # [N, V]
        draft_probs = None if drafted.draft_probs is None else drafted.draft_probs[None]
        path, n, final = verify_tree_batched(tokens[None], drafted.parents, draft_probs, target_probs[None],
                                             dec.generator, drafted.scheme)
        flat = torch.cat([n, final, path[0], tokens[path[0].clamp_min(0)]]).tolist()  # the round's host sync
        n, final, D = flat[0], flat[1], path.shape[1]
        nodes, node_tokens = flat[2 : 2 + n + 1], flat[2 + D + 1 : 2 + D + 1 + n]
        dec.round_alpha, dec.round_tree = [], (drafted.parents, nodes)
        return (nodes, node_tokens + [final]), hidden
    draft_tokens, draft_probs = drafted
    tokens = torch.cat([dec.next_token, draft_tokens])  # [γ+1]
    logits, hidden = dec.model(tokens[None], dec.length, hidden_layers=dec.layers)
    if draft_probs is None:  # greedy: what the rule reduces to, without one-hot rows or a race over the vocabulary
        return verify_greedy(dec, draft_tokens, logits), hidden
    target_probs = dec.sampling.probs(logits)  # [γ+1, V]
    n, final = verify_chain_batched(draft_tokens[None], draft_probs[None], target_probs[None], dec.generator)
    if dec.gamma:  # Σ min(p, q) per position, kept on the device until the round's one sync
        alpha = torch.minimum(target_probs[:-1], draft_probs).sum(-1)
        flat = torch.cat([n.float(), final.float(), draft_tokens.float(), alpha]).tolist()
        dec.round_alpha = flat[2 + dec.gamma:]
    else:
        dec.round_alpha = []
        flat = torch.cat([n, final, draft_tokens]).tolist()
    n, final = int(flat[0]), int(flat[1])
    return (None, [int(t) for t in flat[2 : 2 + n]] + [final]), hidden


def verify_greedy(dec: Decoder, draft_tokens: torch.Tensor, logits: torch.Tensor):
    """T = 0 chain verdict: keep drafts while they equal the target's argmax (first maximal id, as
    probs_from_logits' one-hot has it), then emit the argmax after the last kept one. ~2.5 ms less per round
    than the general rule on SmolLM2's 49k vocabulary (docs/results/serving-and-adaptive.md)."""
    best = logits.argmax(-1)  # [γ+1]
    hits = draft_tokens == best[:-1]
    n = hits.long().cumprod(0).sum()
    flat = torch.cat([n[None], best, hits.long()]).tolist()  # the round's host sync
    n, G = flat[0], dec.gamma
    dec.round_alpha = [float(h) for h in flat[2 + G :]]  # Σ min(p, q) of two one-hots: 1 on a match
    return None, [int(t) for t in flat[1 : 1 + n + 1]]


def accept(dec: Decoder, verdict, hidden) -> list[int]:
    """Keep the accepted rows in the target cache, commit them to the head; return the emitted tokens."""
    path, emitted = verdict
    n = len(emitted)  # accepted drafts + the target's own token
    start = dec.length
    if path is not None:
        rows = torch.tensor(path, device=dec.model.device)
        if path != list(range(n)):  # gather the accepted branch into consecutive slots after the root
            dec.model.compact(start + rows[1:], start + 1)
        hidden = {k: h[:, rows] for k, h in hidden.items()}
    else:
        hidden = {k: h[:, :n] for k, h in hidden.items()}
    depth = dec.tree.depth if dec.tree is not None else dec.gamma
    dec.stats.add_round(n - 1, depth, dec.round_alpha if path is None else ())
    if dec.adaptive is not None and path is None:
        dec.adaptive.observe(dec.gamma, dec.round_alpha[:n])  # the reached positions: accepted + 1
    elif dec.adaptive is not None:
        dec.adaptive.observe_tree(*dec.round_tree)
    tokens = torch.tensor(emitted, device=dec.model.device)
    dec.length, dec.next_token = start + n, tokens[-1:]
    if dec.head is not None:
        if dec.adaptive is not None and dec.gamma == 0 and dec.tree is None:
            dec.backlog.append((hidden, tokens[None], start))
        else:
            dec.head_logits, dec.head_state = dec.head.commit(dec.head_cache, hidden, tokens[None], start)
    return emitted


def choose_setting(dec: Decoder) -> None:
    """Adaptive: this round's γ or tree; when it drafts, first commit the plain rounds' features the head missed."""
    index = dec.adaptive.choose()
    dec.trace.append(index)
    dec.gamma, dec.tree = dec.adaptive.settings[index].gamma, dec.trees[index]
    if (dec.gamma or dec.tree) and dec.backlog:
        hidden = {k: torch.cat([h[k] for h, _, _ in dec.backlog], dim=1) for k in dec.backlog[0][0]}
        tokens = torch.cat([t for _, t, _ in dec.backlog], dim=1)  # [1, n]
        dec.head_logits, dec.head_state = dec.head.commit(dec.head_cache, hidden, tokens, dec.backlog[0][2])
        dec.backlog = []


@torch.inference_mode()  # plain decoding took 0.926x the time of no_grad on CPU (docs/results/step-cost.md)
def generate(dec: Decoder, prompt: torch.Tensor, max_new_tokens: int, stop_ids=()) -> tuple[list[int], Stats]:
    """Decode up to max_new_tokens after prompt [P] (stopping after a stop id). Returns (tokens, this call's stats)."""
    dec.stats, dec.backlog, dec.trace = Stats(), [], []
    if dec.adaptive is not None:
        dec.adaptive.reset()
    t0 = time.perf_counter()
    prompt = prompt.clone()  # an inference tensor, as every later input: a compiled model keeps a graph for each kind
    out = [prefill(dec, prompt, max_new_tokens)]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        if dec.adaptive is not None:
            started = time.perf_counter()
            choose_setting(dec)
        drafted = draft(dec)
        verdict, hidden = verify(dec, drafted)
        out += accept(dec, verdict, hidden)
        if dec.adaptive is not None:
            dec.adaptive.observe_time(dec.trace[-1], time.perf_counter() - started)
    if dec.model.device.type == "cuda":
        torch.cuda.synchronize()
    out = out[:max_new_tokens]
    stop = next((i for i, t in enumerate(out) if t in stop_ids), None)
    if stop is not None:
        out = out[: stop + 1]
    dec.stats.seconds = time.perf_counter() - t0
    dec.stats.new_tokens = len(out)
    return out, dec.stats
