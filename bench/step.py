"""What one decode step and one verify pass cost: serve/model.py against HF, the weight-read bound and llama.cpp.

    python -m bench step --threads 2 --out step_out

On the same target, threads and cached context (--context tokens), best of --reps interleaved runs:
- serve/model.py as it runs (few-token projections as the product serve/linear.py timed fastest here), and with
  few-token passes as plain x·Wᵀ (FEW_TOKENS = 0; the one-token path is the same code in both), and with few-token
  attention split over all --threads (SERIAL_ATTENTION_TOKENS = 0; serve runs it on one thread);
- with --compile: serve/model.py under torch.compile (Transformer.compile), and --ab-steps alternating one-token
  steps of it and the eager model;
- HF's forward with its own cache;
- serve/model.py with bf16 weights (half the bytes to read; not exact against the fp32 target's greedy text);
- the weight-read bound: one pass summing every weight matrix (what a step must at least read);
- llama.cpp's llama-bench on the same target as an f32 GGUF (tg = one-token step, pp4 = a 4-token pass), when
  scripts/engine_env.sh llamacpp has built it: one repetition after each round of the others, best of --reps.
Prints ms per one-token step, r(n) = an n-token pass ÷ one token, and each step ÷ llama.cpp's; writes OUT/step.json
and OUT/step.md. (To compare two revisions, run it in a `git worktree` of each, alternately: ratios only within one
run are steady on a shared machine, so compare each run's step ÷ llama.cpp or ÷ HF column.)
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench import common
from heads.target import engine_venvs


def add_arguments(p) -> None:
    common.add_common(p, "target", "threads", "reps", "compile", "out", threads=2, reps=7, out="step_out")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--skip", nargs="+", default=[], choices=["x-wt", "all-threads", "hf", "bound", "llama"],
                   help="leave rows out (a busy machine): few tokens as x·Wᵀ, attention on all threads, HF, "
                        "the weight-read bound, llama.cpp")
    p.add_argument("--ab-steps", type=int, default=60, help="with --compile: alternating one-token step pairs, "
                   "compiled and eager (the median per-pair ratio is steadier than best-of-reps)")
    p.add_argument("--llama-poll", type=int, default=50, help="llama-bench --poll: 50 (its default) spins its "
                   "threads between ops, which on a busy machine costs it seconds a token; 0 lets them sleep")
    p.add_argument("--llama-timeout", type=float, default=60, help="seconds before a llama-bench run is dropped")


class HFStep:
    """HF forward over n tokens after a fixed cached context (the cache is cropped back after each pass)."""

    def __init__(self, hf_model, ids, context):
        self.model, self.ids, self.context = hf_model, ids, context
        with torch.no_grad():
            self.cache = hf_model(ids[:, :context], use_cache=True).past_key_values  # the returned cache

    @torch.no_grad()
    def __call__(self, n):
        self.model(self.ids[:, self.context : self.context + n], cache=self.cache, use_cache=True)
        self.cache.crop(-n)  # back to the context: the next pass sees the same cache


def serve_step(model, ids, context):
    model.setup_cache(context + 32)
    model(ids[:, :context], 0, last_only=True)
    return lambda n: model(ids[:, context : context + n], context)


def paired_ratio(new, old, steps: int) -> float:
    """Median of new/old over one-token steps taken in pairs, the order flipped every pair."""
    ratios = []
    for i in tqdm(range(steps), desc="pairs", leave=False):
        pair = {}
        for name, fn in ((("new", new), ("old", old)) if i % 2 else (("old", old), ("new", new))):
            t0 = time.perf_counter()
            fn(1)
            pair[name] = time.perf_counter() - t0
        ratios.append(pair["new"] / pair["old"])
    return statistics.median(ratios)


class LlamaBench:
    """llama.cpp's llama-bench on the same target as an f32 GGUF: each call is one repetition (tg = one-token
    steps, pp4 = one 4-token pass, both after the same cached context, -d); ``result()`` keeps the best of each."""

    def __init__(self, target_dir: Path, out: Path, threads: int, context: int, poll: int, timeout: float):
        venv = engine_venvs() / "llamacpp"
        gguf = out / "target-f32.gguf"
        if not gguf.exists():
            subprocess.run([str(venv / "bin" / "python"), str(venv / "llama.cpp" / "convert_hf_to_gguf.py"),
                            str(target_dir), "--outtype", "f32", "--outfile", str(gguf)], check=True,
                           capture_output=True, env={**os.environ, "PYTHONPATH": ""})
        self.cmd = [str(venv / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "4", "-n", "32",
                    "-d", str(context), "-r", "1", "--poll", str(poll), "-o", "json"]
        self.tg = self.pp4 = 0.0  # best tokens/s seen
        self.timeout, self.timeouts = timeout, 0

    @staticmethod
    def available() -> bool:
        return (engine_venvs() / "llamacpp" / "bin" / "llama-bench").exists()

    def __call__(self):
        try:  # its threads wait for each other between ops: on a busy machine one run can take minutes
            proc = subprocess.run(self.cmd, capture_output=True, text=True, check=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.timeouts += 1
            return
        rows = json.loads(proc.stdout)
        self.tg = max(self.tg, next(r for r in rows if r["n_gen"] > 0)["avg_ts"])
        self.pp4 = max(self.pp4, next(r for r in rows if r["n_prompt"] == 4)["avg_ts"])

    def result(self) -> dict | None:  # pp4 is one 4-token pass: 4 / pp4 seconds
        if self.timeouts:
            print(f"llama.cpp: {self.timeouts} of its runs took over {self.timeout:g} s and were dropped")
        if not self.tg:
            return None
        return {"step_s": 1 / self.tg, "pass4_s": 4 / self.pp4, "r4": (4 / self.pp4) * self.tg,
                "tg_tokens_per_s": self.tg, "pp4_tokens_per_s": self.pp4}


def main(args):
    from heads.target import load_target, resolve_path
    from serve import linear as serve_linear
    from serve import model as serve_model
    from serve.model import Transformer

    out = common.start(args, "step")
    target = load_target(args.target)
    hf = target.model
    V = hf.config.vocab_size
    ids = torch.randint(0, V, (1, args.context + max(args.sizes)), generator=torch.Generator().manual_seed(0))
    model = Transformer.from_hf(hf)
    run = serve_step(model, ids, args.context)

    def plain_linear(n):  # the same model with every projection as x·Wᵀ (FEW_TOKENS = 0)
        saved, serve_linear.FEW_TOKENS = serve_linear.FEW_TOKENS, 0
        try:
            return run(n)
        finally:
            serve_linear.FEW_TOKENS = saved

    def threaded_attention(n):  # the same model with attention split over every thread (SERIAL_ATTENTION_TOKENS = 0)
        saved, serve_model.SERIAL_ATTENTION_TOKENS = serve_model.SERIAL_ATTENTION_TOKENS, 0
        try:
            return run(n)
        finally:
            serve_model.SERIAL_ATTENTION_TOKENS = saved

    methods = {"serve": run}
    if "x-wt" not in args.skip:
        methods["serve, few tokens as x·Wᵀ"] = plain_linear
    if args.threads > 1 and "all-threads" not in args.skip:
        methods["serve, attention on all threads"] = threaded_attention
    if args.compile:  # prefilled eagerly, so only the step and pass shapes compile (in timings' warm-up)
        compiled = Transformer.from_hf(hf)
        methods["serve, compiled"] = serve_step(compiled, ids, args.context)
        compiled.compile()
    if "hf" not in args.skip:
        methods["hf"] = HFStep(hf, ids, args.context)
    weights = [p for p in model.parameters() if p.dim() == 2]
    if "bound" not in args.skip:
        methods["weight-read bound"] = lambda n: [w.sum() for w in weights]
    if not args.no_bf16:
        bf16 = Transformer.from_hf(load_target(args.target).model.to(torch.bfloat16))
        methods["serve, bf16 weights"] = serve_step(bf16, ids, args.context)
    bench = LlamaBench(Path(resolve_path(args.target, None)), out, args.threads, args.context, args.llama_poll,
                       args.llama_timeout) \
        if LlamaBench.available() and "llama" not in args.skip else None
    if bench is None and "llama" not in args.skip:
        print(f"llama.cpp: no {engine_venvs()}/llamacpp/bin/llama-bench (run scripts/engine_env.sh llamacpp); skipped")
    best = common.best_of(methods, args.sizes, args.reps, between=bench)
    llama = bench.result() if bench else None
    paired_compiled = None
    if args.compile and args.ab_steps:
        paired_compiled = paired_ratio(methods["serve, compiled"], methods["serve"], args.ab_steps)
    rows = []
    for name, t in best.items():
        row = {"method": name, "step_ms": 1e3 * t[1], **{f"r({n})": t[n] / t[1] for n in args.sizes if n > 1}}
        if llama:
            row["step / llama.cpp"] = t[1] / llama["step_s"]
        rows.append(row)
    if llama:
        rows.append({"method": f"llama.cpp f32 (llama-bench, poll {args.llama_poll})",
                     "step_ms": 1e3 * llama["step_s"], "r(4)": llama["r4"], "step / llama.cpp": 1.0})
    settings = {k: v for k, v in vars(args).items() if k not in ("module", "subcommand")}
    picked = {f"{m.out_features}x{m.in_features}": m.few for m in model.modules() if isinstance(m, serve_linear.Linear)}
    report = common.record(target=args.target, context=args.context, sizes=args.sizes, reps=args.reps,
                           rows=rows, llama_bench=llama, compiled_over_eager_paired=paired_compiled,
                           few_token_products=picked, settings=settings)
    common.write(out, "step", report, markdown(report))


def markdown(report: dict) -> str:
    cols = ["step_ms"] + [f"r({n})" for n in report["sizes"] if n > 1]
    cols += ["step / llama.cpp"] if report["llama_bench"] else []
    lines = common.header(report, f"One decode step and one verify pass on {report['target']}",
                          f"{report['context']} cached tokens · best of {report['reps']} interleaved rounds")
    lines += ["| method | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for row in report["rows"]:
        lines.append(f"| {row['method']} | " + " | ".join(f"{row[c]:.2f}" if c in row else "" for c in cols) + " |")
    if report["compiled_over_eager_paired"] is not None:
        lines += ["", f"One-token step, serve compiled ÷ eager: {report['compiled_over_eager_paired']:.3f} (median "
                  f"over {report['settings']['ab_steps']} alternating pairs)."]
    lines += ["", "step_ms: one one-token step after the cached context; r(n): an n-token pass ÷ a one-token step.",
              "", "Few-token products serve/linear.py picked here (weight shape: up to T tokens → product): " +
              "; ".join(f"{shape}: " + ", ".join(f"≤{upto} {p}" for upto, p in spans)
                        for shape, spans in report.get("few_token_products", {}).items()), ""]
    return "\n".join(lines)
