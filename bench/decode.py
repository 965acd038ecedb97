"""Side-by-side decoding speed on one target: HF generate, HF prompt lookup, HF assistant early exit, this runner
vanilla, and this runner with each head (chain, tree where the family has one, adaptive γ and adaptive trees), at
greedy and T=1.

    python -m bench decode --heads runs/eagle3 runs/eagle runs/medusa runs/mtp --out bench_out
    python -m bench decode --quick --target tiny-random --out /tmp/bench   # smoke test: untrained heads, seconds
    python -m bench decode --heads runs/eagle3 --gamma 3 --baselines hf_generate   # one chain: bench engines' row

Every method decodes the same Spec-Bench subset (--per-task prompts from each of its six tasks, first turn,
chat-templated) from the test split (heads/splits.py), interleaved prompt by prompt so load on the machine hits all
methods alike; a head whose acceptance.json α was measured on any of these prompts is refused. γ and tree sizes
come from serve/auto.py (the head's acceptance.json α and the costs r(n), c measured here). Reported per method:
tokens/s, ratio to HF generate and to the runner's vanilla loop, τ measured, and τ and speedup predicted before the
run from acceptance.json alone (serve/auto.py's chain walk or tree model, with the costs measured here), so that
prediction and measurement are independent. Writes OUT/bench.json, OUT/bench.md (with date and machine) and
OUT/bench.png.
Missing heads can be trained first (--train FAMILY...: runs train/main.py as a subprocess).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import common
from heads import build_head
from heads.checkpoint import check_target, load_head
from heads.errors import UserError
from serve import auto
from serve.adaptive import Adaptive
from serve.generate import Decoder, Sampling, Stats, generate
from serve.loading import ready_to_draft
from serve.prompts import check_unseen, stop_ids
from serve.setting import Costs, Setting
from serve.tree import MEDUSA_TREE, make_tree

ROOT = common.ROOT
TREES = {"medusa": "static", "eagle": "dynamic", "eagle3": "dynamic"}
HF_METHODS = ("hf_generate", "hf_prompt_lookup", "hf_early_exit")


def add_arguments(p) -> None:
    common.add_common(p, "target", "prompts", "split", "per-task", "limit", "max-new-tokens", "temperatures",
                      "threads", "compile", "out", per_task=4, out="bench_out")
    p.add_argument("--heads", nargs="*", default=[], help="head dirs (DIR or DIR/head) with acceptance.json beside")
    p.add_argument("--untrained", nargs="*", default=[], help="families to add as untrained heads (smoke tests)")
    p.add_argument("--train", nargs="*", default=[], help="families to train first with train/main.py")
    p.add_argument("--train-overrides", nargs="*", default=[], help="extra train/main.py overrides")
    p.add_argument("--early-exit-layer", type=int, default=None, help="HF assistant_early_exit (default L/4)")
    p.add_argument("--prompt-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens")
    p.add_argument("--baselines", nargs="*", default=list(HF_METHODS), choices=HF_METHODS,
                   help="which HF methods to run (hf_generate is the reference every ratio needs)")
    p.add_argument("--gamma", type=int, default=None,
                   help="one chain of this γ per head instead of serve/auto.py's picks (no tree, no adaptive row): "
                        "the setting `bench engines` gives the engines")
    p.add_argument("--quick", action="store_true", help="2 prompts, 16 tokens, greedy only: a smoke test")


def check_args(args) -> None:
    if "hf_generate" not in args.baselines:
        raise UserError("--baselines must include hf_generate: every row's ratio is to it")
    if args.quick:
        args.per_task, args.limit, args.max_new_tokens, args.temperatures = 1, 2, 16, [0.0]
        if not args.heads and not args.untrained:
            args.untrained = ["medusa", "eagle", "eagle3", "mtp"]


def train_heads(args, out: Path) -> list[str]:
    dirs = []
    for family in args.train:
        run = out / "heads" / family
        if not (run / "head" / "config.json").exists():
            cmd = [sys.executable, "train/main.py", f"head={family}", f"target={args.target}", "logger=none",
                   f"hydra.run.dir={run}", *args.train_overrides]
            print("training:", " ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)
        dirs.append(str(run))
    return dirs


def load_heads(args, dirs, target, model) -> list[dict]:
    heads = []
    for d in dirs:
        path = Path(d)
        path = path / "head" if (path / "head" / "config.json").exists() else path
        head, config = load_head(path, device=str(model.device))
        check_target(config, target.identity())
        heads.append({"head": head, "dir": path, "label": f"{head.family}"})
    for family in args.untrained:
        head = build_head(family, target.dims, num_steps=3)
        head.attach_modules(model.embed_tokens, model.lm_head, model.norm)
        head.init_from_target()
        heads.append({"head": head, "dir": None, "label": f"{family} (untrained)"})
    for h in heads:
        ready_to_draft(h["head"], model, model.dtype)
    return heads


def alphas_for(h, temperature) -> dict | None:
    """serve.auto.read_acceptance's record for this head at T (chain figures if any), or None without one."""
    if h["dir"] is None:
        return None
    try:
        return auto.read_acceptance(auto.find_acceptance(h["dir"]), temperature)
    except (FileNotFoundError, ValueError):
        return None


def settings_for(h, alphas, costs: Costs, fixed_gamma=None) -> list[Setting]:
    """The chain and (where the family has one) the tree the runner would pick, and adaptive γ; defaults without
    α (and no adaptive row: it needs α as its prior). ``fixed_gamma``: that one chain only."""
    head, family = h["head"], h["head"].family
    steps = head.max_draft_steps
    if fixed_gamma:
        return [Setting.chain(min(fixed_gamma, steps or fixed_gamma))]
    tree = TREES.get(family)
    if alphas is None:
        out = [Setting.chain(min(3, steps or 3))]
        if tree == "static":
            out.append(Setting.static_tree([p for p in MEDUSA_TREE if len(p) <= min(3, steps)]))
        elif tree == "dynamic":
            out.append(Setting.dynamic_tree(4, 4, 16))
        return out
    rows = auto.candidates(family, steps, alphas, tree)
    best = lambda cands: max(cands, key=lambda s: auto.predict(s, alphas, costs)["speedup_predicted"])
    out = [best([s for s in rows if s.kind == "chain"])]  # γ = 0 is the vanilla row
    if tree:
        out.append(best([s for s in rows if s.kind == "tree"]))
    return out + [Setting.adaptive_over(None)] + ([Setting.adaptive_over(tree)] if tree else [])


def predicted(s: Setting, read: dict, costs: Costs) -> dict:
    """τ and speedup over vanilla predicted from acceptance.json alone (``read``: auto.read_acceptance) and the
    costs measured before decoding: serve/auto.py's chain walk for chains, its tree model for trees."""
    pred = auto.predict(s, read["alpha"], costs, read["tau_chain"], ranks=read["ranks"])
    return {"tau": pred["tau_predicted"], "speedup": pred["speedup_predicted"]}


def hf_runner(target, kind, args, stops):
    L = target.dims.num_layers
    extra = {"hf_generate": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": args.prompt_lookup},
             "hf_early_exit": {"assistant_early_exit": args.early_exit_layer or max(1, L // 4)}}[kind]

    def run(prompt, temperature, seed):
        torch.manual_seed(seed)
        ids = prompt[None]
        sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                    eos_token_id=sorted(stops), pad_token_id=target.tokenizer.pad_token_id,
                                    **sample, **extra)
        return out[0, ids.shape[1]:].tolist(), None

    return run


def our_runner(model, head, setting: Setting, stops, max_new_tokens, alphas=None, costs: Costs | None = None):
    tree = make_tree(setting, model.device)  # None for a chain and for adaptive (its candidates have their own)
    decoders = {}

    def run(prompt, temperature, seed):
        if temperature not in decoders:
            adaptive = None
            if setting.adaptive:
                steps = head.max_draft_steps or len(alphas)
                candidates = auto.candidates(head.family, head.max_draft_steps, alphas, setting.tree)
                adaptive = Adaptive(alphas[:steps], costs, settings=candidates, pass_s=costs.pass_s)
            decoders[temperature] = Decoder(model, head, Sampling(temperature), gamma=setting.gamma,
                                            tree=tree, adaptive=adaptive)
        dec = decoders[temperature]
        dec.generator.manual_seed(seed)
        return generate(dec, prompt, max_new_tokens, stops)

    return run


def main(args):
    check_args(args)
    out = common.start(args, "bench")
    head_dirs = list(args.heads) + train_heads(args, out)
    target, model, device = common.load_runner(args)
    heads = load_heads(args, head_dirs, target, model)
    prompts = common.spec_bench(args, target.tokenizer)
    for h in heads:  # refuse prompts a head's α was measured on: its prediction would agree by construction
        h["prompts_unseen_by_alpha"] = check_unseen(prompts, auto.find_acceptance(h["dir"])) if h["dir"] else None
    stops = stop_ids(target.tokenizer, target.model.config)

    sizes = [1, 2, 4, 17] if args.quick else sorted(set(range(1, 10)) | {17, 25, 33, 49, 65})
    if args.gamma:  # one chain: only r(γ + 1) is read
        sizes = [1, args.gamma + 1]
    for h in heads:
        h["costs"] = auto.measure_costs(model, h["head"], sizes, reps=2 if args.quick else 5)
    results = {}
    for T in args.temperatures:
        methods = {k: {"run": hf_runner(target, k, args, stops)} for k in args.baselines}
        methods["vanilla"] = {"run": our_runner(model, None, Setting.chain(0), stops, args.max_new_tokens)}
        for h in heads:
            read = alphas_for(h, T)
            alphas = read["alpha"] if read else None
            for s in settings_for(h, alphas, h["costs"], args.gamma):
                name = f"{h['label']}: {s.describe()}"
                methods[name] = {"run": our_runner(model, h["head"], s, stops, args.max_new_tokens, alphas,
                                                   h["costs"]), "setting": s, "head": h, "read": read}
        for m in methods.values():  # warm-up, untimed (compiled: the decode passes compile here)
            m.update(tokens=0, seconds=0.0, stats=Stats())
            m["run"](torch.tensor(prompts[0]["prompt_ids"][:32], device=device), T, 0)
        for i, p in enumerate(prompts):
            prompt = torch.tensor(p["prompt_ids"], device=device)
            for name, m in methods.items():
                t0 = time.perf_counter()
                tokens, stats = m["run"](prompt, T, i)
                if device == "cuda":
                    torch.cuda.synchronize()
                m["seconds"] += time.perf_counter() - t0
                m["tokens"] += len(tokens)
                if stats is not None:
                    m["stats"].merge(stats)
            print(f"T={T} prompt {i + 1}/{len(prompts)} done", flush=True)
        results[T] = summarise(methods)
    report = common.record(target=args.target, compiled=args.compile, prompts=len(prompts), split=args.split,
                           question_ids=[p["question_id"] for p in prompts],
                           prompts_unseen_by_alpha={h["label"]: h["prompts_unseen_by_alpha"] for h in heads},
                           per_task=args.per_task, max_new_tokens=args.max_new_tokens,
                           costs={h["label"]: h["costs"].to_json() for h in heads},
                           results={str(T): rows for T, rows in results.items()})
    plot(report, out / "bench.png")
    common.write(out, "bench", report, markdown(report))


def summarise(methods) -> list[dict]:
    tps = {n: m["tokens"] / m["seconds"] for n, m in methods.items()}
    rows = []
    for name, m in methods.items():
        row = {"method": name, "tokens": m["tokens"], "seconds": m["seconds"], "tokens_per_s": tps[name],
               "x_hf_generate": tps[name] / tps["hf_generate"], "x_vanilla": tps[name] / tps["vanilla"]}
        if "setting" in m and m["setting"].adaptive:
            summary = m["stats"].summary()
            row.update(setting=m["setting"].to_json(), tau_measured=summary["tau_measured"],
                       rounds_per_gamma=summary["rounds_per_draft_depth"])
        elif "setting" in m:
            s, summary = m["setting"], m["stats"].summary()
            row.update(setting=s.to_json(paths=False),
                       tau_measured=summary["tau_measured"],
                       accept_rate_per_position=summary["accept_rate_per_position"])
            if m["read"]:  # predicted before the run, from acceptance.json (other text) and the measured costs
                pred = predicted(s, m["read"], m["head"]["costs"])
                row.update(tau_predicted_from_alpha=pred["tau"], speedup_predicted_from_alpha=pred["speedup"],
                           measured_over_predicted=row["x_vanilla"] / pred["speedup"])
        elif name == "vanilla":
            row["tau_measured"] = 1.0
        rows.append(row)
    return rows


def markdown(report) -> str:
    lines = common.header(report, f"Decoding speed on {report['target']}",
                          f"{report['prompts']} Spec-Bench prompts ({report['per_task']} per task) · "
                          f"{report['max_new_tokens']} new tokens"
                          f"{' · runner compiled (HF eager)' if report.get('compiled') else ''}")
    fmt = lambda v, spec: "" if v is None else format(v, spec)
    for T, rows in report["results"].items():
        lines += [f"## temperature {T}", "",
                  "| method | tokens/s | × HF generate | × vanilla | τ measured | τ predicted (α) | "
                  "× vanilla predicted (α) | measured ÷ predicted |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['x_hf_generate']:.2f} | "
                         f"{r['x_vanilla']:.2f} | {fmt(r.get('tau_measured'), '.2f')} | "
                         f"{fmt(r.get('tau_predicted_from_alpha'), '.2f')} | "
                         f"{fmt(r.get('speedup_predicted_from_alpha'), '.2f')} | "
                         f"{fmt(r.get('measured_over_predicted'), '.0%')} |")
        lines.append("")
    lines += [f"Prompts: the {report['split']} split (heads/splits.py). τ and × vanilla predicted (α): before the "
              "run, from the head's acceptance.json (α measured on its validation prompts, none of which is decoded "
              "here) and the r(n), c measured here, by serve/auto.py's chain walk or tree model.", ""]
    return "\n".join(lines)


def plot(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(report["results"])
    fig, axes = plt.subplots(2, len(temps), figsize=(6.5 * len(temps), 8), squeeze=False)
    for j, T in enumerate(temps):
        rows = report["results"][T]
        names = [r["method"] for r in rows]
        y = range(len(rows))
        ax = axes[0][j]
        ax.barh(y, [r["x_hf_generate"] for r in rows], color="tab:blue")
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_yticks(list(y), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("speedup over HF generate")
        ax.set_title(f"T={T}")
        ax = axes[1][j]
        ax.barh([i - 0.2 for i in y], [r.get("tau_measured") or 0 for r in rows], 0.4, label="τ measured")
        ax.barh([i + 0.2 for i in y], [r.get("tau_predicted_from_alpha") or 0 for r in rows], 0.4,
                label="τ predicted from α")
        ax.set_yticks(list(y), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("tokens per target pass")
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['target']}: {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
