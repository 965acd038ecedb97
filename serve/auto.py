"""Choose γ (or a tree's size) from the head's measured α and this machine's measured costs.

A round costs one target pass over n tokens, r(n) in units of a one-token pass, plus the head calls, c each (same
unit); it yields E tokens on average. Predicted speedup over vanilla decoding = E / (r(n) + calls · c):
- chain γ: n = γ + 1, calls = γ (commit + γ − 1 steps), E = heads.losses.tau_predicted(α)[γ];
- γ = 0, plain decoding: n = 1, no head calls, E = 1, so exactly 1×. It is a candidate like the others, so a head
  that nothing predicts to pay for is switched off rather than served at a loss;
- tree of N drafted nodes and depth D: n = N + 1, calls = D (EAGLE-2: commit + one multi-node step per level;
  Medusa: its D heads), E from serve/tree.py's positional-acceptance model (an approximation: it treats each
  rejected sibling as leaving the next the same chance α_d).
The passes are not the whole round: the drafting loop, verify's sampling and host sync, the commits and a tree's
mask cost Python and small kernels, which on a small CPU target rival the pass. serve/calibrate.py times whole
rounds of plain decoding and of each kind's best setting, and ``excess`` (per kind, in target passes) adds the rest
to every setting of that kind; the speedup is then over a timed plain round.
α comes from ``acceptance.json`` (train/ writes it beside DIR/head), at the serving temperature when recorded.
When the record has the chain figures (``alpha_chain``: P(step k kept | steps < k kept), and ``tau_predicted``:
τ from walking the chain over the held-out text) a chain's τ is the walk's and trees use alpha_chain per depth;
older records only have mean α per position, whose product overestimates τ (hard contexts reject every step
together). ``read_acceptance`` says which it used. Everything the choice used is returned, and the CLI writes it
into bench.json.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from heads.losses import tau_predicted
from serve.setting import Costs, Setting
from serve.tree import MEDUSA_TREE, expected_tau_dynamic, expected_tau_paths


def find_acceptance(head_path: str | Path, explicit: str | Path | None = None) -> Path:
    if explicit:
        path = Path(explicit)
        if path.is_dir():
            path = path / "acceptance.json"
        if not path.exists():
            raise FileNotFoundError(f"acceptance_path={explicit}: no such file")
        return path
    for candidate in (Path(head_path) / "acceptance.json", Path(head_path).parent / "acceptance.json"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"gamma=auto needs acceptance.json in or beside {head_path} (train/main.py writes it; "
                            f"mode=eval measures one) or acceptance_path=FILE; or set gamma=N")


def read_alphas(path: Path, temperature: float) -> tuple[list[float], float]:
    """α per draft position at the recorded temperature nearest the serving one -> (alphas, that temperature)."""
    record = json.loads(Path(path).read_text())
    by_t = {float(t): a for t, a in (record.get("alpha_by_temperature") or {}).items()}
    if not by_t and "alpha" in record:
        by_t = {float(record.get("temperature", temperature)): record["alpha"]}
    if not by_t:
        raise ValueError(f"{path} has no 'alpha' per draft position; is it a draftheads acceptance.json?")
    t = min(by_t, key=lambda x: abs(x - temperature))
    return [float(a) for a in by_t[t]], t


CHAIN_WALK = "chain walk (alpha_chain, tau_predicted)"
PRODUCT = "product of mean α per position"


def _at_temperature(by_t: dict | None, t: float):
    """A by-temperature record's entry at exactly t (the temperature read_alphas chose), else None."""
    return {float(k): v for k, v in (by_t or {}).items()}.get(t)


def read_acceptance(path: Path, temperature: float) -> dict:
    """-> {"alpha": the per-position rates predictions use, "tau_chain": {γ: τ} or None, "temperature",
    "source": CHAIN_WALK or PRODUCT, "alpha_mean": mean α per position, "ranks": alpha_rank or None}. The
    chain figures are used when the record has them at the chosen temperature."""
    record = json.loads(Path(path).read_text())
    alphas, t = read_alphas(path, temperature)
    chain = _at_temperature(record.get("alpha_chain_by_temperature"), t)
    walk = _at_temperature(record.get("tau_predicted_by_temperature"), t)
    if chain is None and "alpha_chain" in record and float(record.get("temperature", t)) == t:
        chain, walk = record["alpha_chain"], record.get("tau_predicted")
    ranks = _at_temperature(record.get("alpha_rank_by_temperature"), t)  # greedy only: None at T > 0
    if not chain:
        return {"alpha": alphas, "tau_chain": None, "temperature": t, "source": PRODUCT, "alpha_mean": alphas,
                "ranks": ranks}
    tau = {int(g): float(v) for g, v in walk.items()} if isinstance(walk, dict) else None
    return {"alpha": [float(a) for a in chain], "tau_chain": tau, "temperature": t, "source": CHAIN_WALK,
            "alpha_mean": alphas, "ranks": ranks}


def _seconds(fn, reps: int) -> float:
    """Fastest of reps runs: the least disturbed by other work on the machine."""
    return _seconds_interleaved({0: fn}, reps)[0]


def _seconds_interleaved(fns: dict, reps: int) -> dict:
    """Fastest of reps runs of each fn, the fns taking turns. Timed one size after another, a slow spell on a shared
    machine landed on some sizes only: r(2) read 0.95 to 1.50 over five runs on one idle CPU
    (docs/results/serving-and-adaptive.md)."""
    for fn in fns.values():  # warm-up (compiled: a graph per new shape)
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


@torch.inference_mode()  # as generate() decodes: a compiled target then times the graphs the decode loop runs
def measure_costs(model, head, sizes, context: int = 256, reps: int = 5) -> Costs:
    """r(n) for n in sizes (target pass over n tokens after ``context`` cached ones, ÷ one token) and c (one
    draft step ÷ one target token), measured on this machine with random tokens."""
    device = model.device
    V = model.config.vocab_size
    model.setup_cache(context + max(sizes) + 2)
    ids = torch.randint(0, V, (1, context + max(sizes)), device=device)
    model(ids[:, :context], 0, last_only=True)
    layers = tuple(head.feature_layers) if head is not None else ()
    passes = {int(n): (lambda n=n: model(ids[:, context : context + n], context, hidden_layers=layers))
              for n in sorted(set(sizes) | {1})}
    seconds = _seconds_interleaved(passes, reps)
    one = seconds[1]
    r = {n: t / one for n, t in seconds.items()}  # r[1] = 1: the unit
    if head is None:
        return Costs(r, pass_s=one, context=context)
    _, hidden = model(ids[:, :context], 0, hidden_layers=layers)
    cache = head.new_cache(context + 64, device, model.dtype)
    logits, state = head.commit(cache, {k: h[:, :-1] for k, h in hidden.items()}, ids[:, 1:context], 0)
    token = logits.argmax(-1)
    depth = 2 if head.max_draft_steps is None or head.max_draft_steps >= 2 else 1
    if depth == 2:
        step = _seconds(lambda: head.step(cache, state, token, 2), reps)
    else:  # a one-step head: its only call is the commit
        step = _seconds(lambda: head.commit(cache, {k: h[:, -2:-1] for k, h in hidden.items()},
                                            ids[:, context - 1 : context], context - 1), reps)
    return Costs(r, step / one, pass_s=one, draft_step_s=step, context=context)


def candidates(family: str, max_steps: int | None, alphas: list[float], tree: str | None) -> list[Setting]:
    """Settings to compare: chain γ up to the measured positions (and the head's limit); trees where they apply."""
    top = len(alphas) if max_steps is None else min(len(alphas), max_steps)
    out = [Setting.chain(g) for g in range(0, top + 1)]
    if tree == "static" and family == "medusa":
        for depth in range(2, top + 1):
            out.append(Setting.static_tree([p for p in MEDUSA_TREE if len(p) <= depth], depth))
    if tree == "dynamic" and family in ("eagle", "eagle3"):
        for depth in range(2, max(top, 2) + 3):  # EAGLE-2 drafts deeper than trained; α_K stands in beyond K
            for total in (8, 16, 24, 32, 48, 64):
                if total <= 4 + (depth - 1) * 16:
                    out.append(Setting.dynamic_tree(depth, 4, total))
    return out


def predict(setting: Setting, alphas: list[float], costs: Costs, tau_chain: dict | None = None,
            excess: dict | None = None, ranks: list | None = None) -> dict:
    """tau_chain: the recorded chain-walk τ per γ, used for chains where it has that γ. excess (round_excess):
    per kind, what a whole round cost beyond its passes, in target passes; the cost is then in plain rounds.
    ranks: the recorded greedy hit rate per draft rank (alpha_rank), for trees' siblings (tree.rank_accept)."""
    s = setting
    if s.kind == "plain":
        return {"tau_predicted": 1.0, "r": 1.0, "cost": 1.0, "speedup_predicted": 1.0}
    if s.kind == "chain":
        n, calls = s.gamma + 1, s.gamma
        tau = (tau_chain or {}).get(n - 1) or tau_predicted(alphas[: s.gamma])[s.gamma]
    elif s.tree == "static":
        n, calls = s.tree_total_tokens + 1, s.tree_depth
        tau = expected_tau_paths(alphas, s.tree_paths, ranks)
    else:
        n, calls = s.tree_total_tokens + 1, s.tree_depth
        tau = expected_tau_dynamic(alphas, s.tree_depth, s.tree_top_k, s.tree_total_tokens, ranks)
    cost = costs.round_cost(n, calls)
    if excess and s.kind in excess:  # a plain round is 1 + excess["plain"] passes: the unit
        cost = (cost + excess[s.kind]) / (1 + excess["plain"])
    return {"tau_predicted": tau, "r": costs.target_pass(n), "cost": cost, "speedup_predicted": tau / cost}


def to_time(table: list[dict], settings: list[Setting]) -> list[Setting]:
    """The settings whose whole rounds are timed: plain decoding and, per drafting kind, the one the passes alone
    predict best (the one that kind would be served with unless its excess changes the ranking)."""
    best = {}
    for row, s in zip(table, settings):
        if s.kind not in best or row["speedup_predicted"] > best[s.kind][0]:
            best[s.kind] = (row["speedup_predicted"], s)
    return [best.pop("plain")[1], *(s for _, s in best.values())]


def round_excess(settings: list[Setting], seconds: list[float], costs: Costs, alphas: list[float]) -> dict:
    """Per kind: a timed round's seconds in target passes, less what the passes alone predict (plain: 1)."""
    return {s.kind: costs.in_passes(t) - predict(s, [1.0] * len(alphas), costs)["cost"]
            for s, t in zip(settings, seconds)}


def choose(family: str, max_steps: int | None, alphas: list[float], costs: Costs, tree: str | None,
           tau_chain: dict | None = None, excess: dict | None = None, ranks: list | None = None) -> dict:
    """-> {"choice": best Setting, "predicted": ..., "table": every candidate (as JSON) with its prediction}."""
    table = []
    for s in candidates(family, max_steps, alphas, tree):
        table.append({**s.to_json(paths=False), **predict(s, alphas, costs, tau_chain, excess, ranks)})
    # max keeps the first of equals: speculation must predict more than plain decoding (candidate 0) to win
    best = max(range(len(table)), key=lambda i: table[i]["speedup_predicted"])
    choice = candidates(family, max_steps, alphas, tree)[best]
    return {"choice": choice, "predicted": table[best], "table": table}


def sizes_for(max_steps: int | None, alphas: list[float], tree: str | None) -> list[int]:
    """Pass lengths the candidates need r(n) for."""
    top = len(alphas) if max_steps is None else min(len(alphas), max_steps)
    sizes = set(range(1, top + 2))
    if tree:
        sizes |= {9, 17, 25, 33, 49, 65}
    return sorted(sizes)
