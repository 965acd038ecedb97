"""Adaptive drafting against the best fixed setting and against plain decoding, head by head (weak and strong).

    python -m bench adaptive --heads runs/eagle3-weak runs/eagle3 --out adaptive_out
    python -m bench adaptive --target stories260k --prompts stories.jsonl --heads /tmp/weak /tmp/strong

Each head is a directory (DIR or DIR/head) with acceptance.json in or beside it. Per head and temperature, on the
same prompts, interleaved prompt by prompt (best of --reps per prompt, so load on the machine hits every method
alike): plain decoding; every fixed chain γ = 1..K; the tree gamma=auto would pick for the family (EAGLE-2 dynamic
or Medusa static); adaptive γ (chains); adaptive trees. "best fixed" is the fastest fixed chain or tree, picked in
hindsight, so adaptive is held to the best any fixed setting did on this text. gamma=auto's own pick is marked.
Reported: tokens/s, × plain, × best fixed, τ measured, and for the adaptive rows the settings chosen (rounds) and
over time (each request's rounds in quarters: the most used setting and the share of plain rounds).
Writes OUT/adaptive.json and OUT/adaptive.md.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from bench import common
from serve import auto, calibrate
from serve.adaptive import Adaptive
from serve.generate import Decoder, Sampling, Stats, generate
from serve.loading import load_draft_head
from serve.prompts import check_unseen, stop_ids
from serve.setting import Costs, Setting
from serve.tree import build_tree

TREES = {"medusa": "static", "eagle": "dynamic", "eagle3": "dynamic"}


def add_arguments(p) -> None:
    common.add_common(p, "target", "prompts", "split", "per-task", "limit", "max-new-tokens", "temperatures", "reps",
                      "threads", "compile", "out", limit=8, out="adaptive_out")
    p.add_argument("--heads", nargs="+", required=True, help="head dirs with acceptance.json in or beside them")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ignore-eos", action="store_true", help="decode --max-new-tokens past end-of-turn: at T > 0 "
                   "each method samples its own text, and unequal lengths spread the prefill unequally")


def methods_for(head, read: dict, costs: Costs) -> dict[str, Setting]:
    """name -> setting: fixed chains, auto's tree, adaptive γ and adaptive trees (plain is added apart)."""
    family, steps, alphas = head.family, head.max_draft_steps, read["alpha"]
    tree = TREES.get(family)
    top = len(alphas) if steps is None else min(len(alphas), steps)
    out = {Setting.chain(g).describe(): Setting.chain(g) for g in range(1, top + 1)}
    predict = lambda s: auto.predict(s, alphas, costs, read["tau_chain"], ranks=read["ranks"])["speedup_predicted"]
    if tree:
        best_tree = max((s for s in auto.candidates(family, steps, alphas, tree) if s.kind == "tree"), key=predict)
        out[best_tree.describe()] = best_tree
    out["adaptive γ"] = Setting.adaptive_over(None)
    if tree:
        out[f"adaptive {tree} tree"] = Setting.adaptive_over(tree)
    return out


def decoder(model, head, setting: Setting, read, costs: Costs, T) -> Decoder:
    adaptive = None
    if setting.adaptive:
        prior = read["alpha"][: head.max_draft_steps] if head.max_draft_steps else read["alpha"]
        candidates = auto.candidates(head.family, head.max_draft_steps, read["alpha"], setting.tree)
        adaptive = Adaptive(prior, costs, settings=candidates, pass_s=costs.pass_s)
    tree = None if adaptive else build_tree(setting, model.device)
    return Decoder(model, head, Sampling(T), gamma=setting.gamma, tree=tree, adaptive=adaptive)


def over_time(traces: list[list[int]], settings: list[Setting], parts: int = 4) -> list[dict]:
    """Each request's rounds cut in ``parts`` equal stretches; per stretch over all requests: the most used
    setting and the share of plain rounds."""
    stretches = [Counter() for _ in range(parts)]
    for trace in traces:
        for i, index in enumerate(trace):
            stretches[i * parts // len(trace)][index] += 1
    out = []
    for c in stretches:
        total = sum(c.values()) or 1
        top, n = c.most_common(1)[0] if c else (0, 0)
        out.append({"most_used": settings[top].describe(), "share": n / total, "plain": c[0] / total})
    return out


def run_head(model, head, head_dir, prompts, stops, args, T) -> dict:
    acc = auto.find_acceptance(head_dir)
    read = auto.read_acceptance(acc, T)
    costs = auto.measure_costs(model, head, auto.sizes_for(head.max_draft_steps, read["alpha"], TREES.get(head.family)))
    record = calibrate.choose(model, head, Sampling(T), read["alpha"], costs, TREES.get(head.family),
                              read["tau_chain"], read["ranks"])  # gamma=auto's choice, as serve/main.py makes it
    settings = methods_for(head, read, costs)
    if record["choice"].kind != "plain":  # auto's pick is always a row (plain is one already)
        settings.setdefault(record["choice"].describe(), record["choice"])
    decoders = {"plain": Decoder(model, None, Sampling(T))}
    decoders.update({name: decoder(model, head, s, read, costs, T) for name, s in settings.items()})
    seconds, tokens = Counter(), Counter()
    stats = {name: Stats() for name in decoders}
    traces = {name: [] for name in decoders}
    for name, dec in decoders.items():  # warm-up
        generate(dec, prompts[0][:16], 8, stops)
    for i, prompt in enumerate(prompts):
        best = {}
        for rep in range(args.reps):
            for name, dec in decoders.items():
                dec.generator.manual_seed(1000 * i + rep)
                t0 = time.perf_counter()
                out, st = generate(dec, prompt, args.max_new_tokens, stops)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                if name not in best or elapsed < best[name][0]:
                    best[name] = (elapsed, len(out), st, list(dec.trace))
        for name, (elapsed, n, st, trace) in best.items():
            seconds[name] += elapsed
            tokens[name] += n
            stats[name].merge(st)
            if trace:
                traces[name].append(trace)
        print(f"{head_dir.name} T={T} prompt {i + 1}/{len(prompts)}", flush=True)
    tps = {name: tokens[name] / seconds[name] for name in decoders}
    fixed = [n for n, s in settings.items() if not s.adaptive]
    best_fixed = max(fixed, key=tps.__getitem__)
    auto_pick = record["choice"].describe()
    rows = []
    for name, dec in decoders.items():
        row = {"method": name, "tokens": tokens[name], "seconds": seconds[name], "tokens_per_s": tps[name],
               "x_plain": tps[name] / tps["plain"], "x_best_fixed": tps[name] / tps[best_fixed],
               "tau_measured": stats[name].summary()["tau_measured"] if name != "plain" else 1.0,
               "best_fixed": name == best_fixed, "auto_pick": name == auto_pick}
        if dec.adaptive is not None:
            chosen = Counter(i for trace in traces[name] for i in trace)
            row["rounds_by_setting"] = {dec.adaptive.settings[i].describe(): n for i, n in chosen.most_common()}
            row["over_time"] = over_time(traces[name], dec.adaptive.settings)
        rows.append(row)
    return {"head": str(head_dir), "family": head.family, "temperature": T, "acceptance_json": str(acc),
            "tau_source": read["source"], "alpha": read["alpha"], "costs": costs.to_json(), "auto_pick": auto_pick,
            "auto_predicted": record["predicted"]["speedup_predicted"], "round_excess": record["round_excess"],
            "auto_passes_only": record["passes_only_choice"],
            "best_fixed": best_fixed, "rows": rows}


def markdown(report) -> str:
    lines = common.header(report, f"Adaptive drafting on {report['target']}",
                          f"{report['prompts']} prompts · {report['max_new_tokens']} new tokens"
                          f"{' (end-of-turn ignored)' if report.get('ignore_eos') else ''} · best of {report['reps']} "
                          f"per prompt{' · compiled' if report.get('compiled') else ''}")
    for r in report["results"]:
        lines += [f"## {r['head']} ({r['family']}), T = {r['temperature']}", "",
                  f"α per position ({r['tau_source']}): {[round(a, 3) for a in r['alpha']]}; "
                  f"c = {r['costs']['c']:.3f}; gamma=auto picks {r['auto_pick']} (predicted "
                  f"{r['auto_predicted']:.2f}×; a round's excess over its passes, in passes: "
                  f"{', '.join(f'{k} {v:.2f}' for k, v in r['round_excess'].items())}; the passes alone would pick "
                  f"{r['auto_passes_only']['setting']} at {r['auto_passes_only']['speedup_predicted']:.2f}×)", "",
                  "| method | tokens/s | × plain | × best fixed | τ | chosen (rounds) | over time (quarters) |",
                  "|---|---:|---:|---:|---:|---|---|"]
        for row in r["rows"]:
            marks = (" **(best fixed)**" if row["best_fixed"] else "") + (" *(auto)*" if row["auto_pick"] else "")
            chosen = ", ".join(f"{k}: {v}" for k, v in list(row.get("rounds_by_setting", {}).items())[:3])
            quarters = " → ".join(f"{q['most_used']} ({q['share']:.0%}; plain {q['plain']:.0%})"
                                  for q in row.get("over_time", []))
            lines.append(f"| {row['method']}{marks} | {row['tokens_per_s']:.1f} | {row['x_plain']:.2f} | "
                         f"{row['x_best_fixed']:.2f} | {row['tau_measured']:.2f} | {chosen} | {quarters} |")
        lines.append("")
    return "\n".join(lines)


def main(args):
    out = common.start(args, "adaptive")
    target, model, device = common.load_runner(args)
    records = common.spec_bench(args, target.tokenizer, args.chat_template)
    prompts = [torch.tensor(p["prompt_ids"], device=device) for p in records]
    stops = () if args.ignore_eos else stop_ids(target.tokenizer, target.model.config)
    results = []
    for d in args.heads:
        head, head_dir = load_draft_head(d, target, model, model.dtype)
        check_unseen(records, auto.find_acceptance(head_dir))  # its α must come from other prompts than these
        for T in args.temperatures:
            results.append(run_head(model, head, head_dir, prompts, stops, args, T))
    report = common.record(target=args.target, compiled=args.compile, prompts=len(prompts),
                           max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, reps=args.reps,
                           results=results)
    common.write(out, "adaptive", report, markdown(report))
