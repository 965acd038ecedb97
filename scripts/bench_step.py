"""What one decode step and one verify pass cost: serve/model.py against HF, the weight-read bound and llama.cpp.

    python scripts/bench_step.py --threads 2 --out step_out

On the same target, threads and cached context (--context tokens), best of --reps interleaved runs:
- serve/model.py as it runs (few-token projections as W·xᵀ), and with few-token passes as plain x·Wᵀ
  (FEW_TOKENS = 0; the one-token path is the same code in both), and with few-token attention split over all
  --threads (SERIAL_ATTENTION_TOKENS = 0; serve runs it on one thread);
- with --compile: serve/model.py under torch.compile (Transformer.compile), and --ab-steps alternating one-token
  steps of it and the eager model;
- with --baseline REV: serve/model.py as it was at git revision REV (before/after a change, in the same run), and
  --ab-steps one-token steps of the two alternating, whose median per-pair ratio is steadier than best-of-reps
  (on a shared 2-core VM best-of-7 whole steps swing ±15% run to run; a pair sees the same moment);
- HF's forward with its own cache;
- serve/model.py with bf16 weights (half the bytes to read; not exact against the fp32 target's greedy text);
- the weight-read bound: one pass summing every weight matrix (what a step must at least read);
- llama.cpp's llama-bench on the same target as an f32 GGUF (tg = one-token step, pp4 = a 4-token pass), when
  scripts/engine_env.sh llamacpp has built it: one repetition after each round of the others, best of --reps.
Prints ms per one-token step, r(n) = an n-token pass ÷ one token, and each step ÷ llama.cpp's; writes OUT/step.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from heads.target import load_target
from serve import model as serve_model
from serve.model import Transformer

VENVS = Path(os.environ.get("DRAFTHEADS_VENVS") or
             Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftheads" / "venvs")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--compile", action="store_true", help="also time serve/model.py under torch.compile "
                   "(Transformer.compile; compiling each pass size takes minutes on a small CPU)")
    p.add_argument("--skip", nargs="+", default=[], choices=["x-wt", "all-threads", "hf", "bound"],
                   help="leave rows out (a busy machine): few tokens as x·Wᵀ, attention on all threads, HF, "
                        "the weight-read bound")
    p.add_argument("--baseline", metavar="REV", help="also time serve/model.py as of this git revision")
    p.add_argument("--ab-steps", type=int, default=60, help="with --baseline or --compile: alternating one-token "
                   "step pairs")
    p.add_argument("--llama-poll", type=int, default=50, help="llama-bench --poll: 50 (its default) spins its "
                   "threads between ops, which on a busy machine costs it seconds a token; 0 lets them sleep")
    p.add_argument("--llama-timeout", type=float, default=60, help="seconds before a llama-bench run is dropped")
    p.add_argument("--out", default="step_out")
    return p.parse_args()


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


def model_at(rev: str):
    """serve/model.py as of git revision rev, imported as its own module (it still imports today's heads/)."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:serve/model.py"], cwd=root, capture_output=True, text=True,
                            check=True).stdout
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(f"serve_model_{rev}", loader=None))
    exec(compile(source, f"{rev}:serve/model.py", "exec"), module.__dict__)
    return module


def timings(methods: dict, sizes, reps, between=None) -> dict:
    """Best of reps per (method, n), methods interleaved so load on the machine hits all alike; ``between()`` runs
    once per round after them (llama.cpp's round, so it meets the same load)."""
    best = {name: {n: float("inf") for n in sizes} for name in methods}
    for name, fn in methods.items():
        for n in sizes:
            fn(n)  # warm-up
    for _ in tqdm(range(reps), desc="rounds", leave=False):
        for name, fn in methods.items():
            for n in sizes:
                t0 = time.perf_counter()
                fn(n)
                best[name][n] = min(best[name][n], time.perf_counter() - t0)
        if between is not None:
            between()
    return best


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
        venv = VENVS / "llamacpp"
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
        return (VENVS / "llamacpp" / "bin" / "llama-bench").exists()

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


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(args.target)
    hf = target.model
    V = hf.config.vocab_size
    ids = torch.randint(0, V, (1, args.context + max(args.sizes)), generator=torch.Generator().manual_seed(0))
    model = Transformer.from_hf(hf)
    run = serve_step(model, ids, args.context)

    def plain_linear(n):  # the same model with every projection as x·Wᵀ (FEW_TOKENS = 0)
        saved, serve_model.FEW_TOKENS = serve_model.FEW_TOKENS, 0
        try:
            return run(n)
        finally:
            serve_model.FEW_TOKENS = saved

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
    if args.baseline:
        methods[f"serve @ {args.baseline}"] = serve_step(model_at(args.baseline).Transformer.from_hf(hf), ids,
                                                         args.context)
    weights = [p for p in model.parameters() if p.dim() == 2]
    if "bound" not in args.skip:
        methods["weight-read bound"] = lambda n: [w.sum() for w in weights]
    if not args.no_bf16:
        bf16 = Transformer.from_hf(load_target(args.target).model.to(torch.bfloat16))
        methods["serve, bf16 weights"] = serve_step(bf16, ids, args.context)
    target_dir = Path(hf.config._name_or_path) if Path(hf.config._name_or_path).is_dir() else \
        Path.home() / ".cache" / "draftheads" / "targets" / args.target
    bench = LlamaBench(target_dir, out, args.threads, args.context, args.llama_poll, args.llama_timeout) \
        if LlamaBench.available() else None
    if bench is None:
        print(f"llama.cpp: no {VENVS}/llamacpp/bin/llama-bench (run scripts/engine_env.sh llamacpp); skipped")
    best = timings(methods, args.sizes, args.reps, between=bench)
    llama = bench.result() if bench else None
    paired = None
    if args.baseline and args.ab_steps:
        paired = paired_ratio(methods["serve"], methods[f"serve @ {args.baseline}"], args.ab_steps)
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
    report = {"rows": rows, "llama_bench": llama, "args": vars(args), "serve_over_baseline_paired": paired,
              "compiled_over_eager_paired": paired_compiled,
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                          "cpus": os.cpu_count(), "torch": torch.__version__, "threads": args.threads},
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (out / "step.json").write_text(json.dumps(report, indent=2))
    cols = ["step_ms"] + [f"r({n})" for n in args.sizes if n > 1] + (["step / llama.cpp"] if llama else [])
    print(f"{'method':40s}" + "".join(f"{c:>18s}" for c in cols))
    for row in rows:
        print(f"{row['method']:40s}" + "".join(f"{row[c]:18.2f}" if c in row else f"{'':18s}" for c in cols))
    if paired_compiled is not None:
        print(f"one-token step, serve compiled ÷ eager: {paired_compiled:.3f} (median over {args.ab_steps} "
              "alternating pairs)")
    if paired is not None:
        print(f"one-token step, serve ÷ serve @ {args.baseline}: {paired:.3f} (median over {args.ab_steps} "
              "alternating pairs)")


if __name__ == "__main__":
    main()
