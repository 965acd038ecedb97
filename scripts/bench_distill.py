"""What self-distillation costs per answer token: train/distill.py's sample() now, against it at a git revision.

    python scripts/bench_distill.py --records 64 --baseline e7454cb --rounds 2

The same seeded slice of ../shared/data/train that mode=distill answers (first turns), greedy, interleaved rounds
(baseline, current, baseline, ...) in one process so load on the machine hits both alike. Prints per run the
answer tokens, wall tokens/s, tokens per CPU-second (steadier than wall on a shared machine), and where the CPU
went (prefill forwards, decode forwards, the rest: sampling, cache copies, Python); then the best-of ratios, and
how many answers differ between the two (greedy: they should not, up to fp32 batch rounding).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch

from heads.target import load_target, shared_dir
from train import distill
from train.distill import DistillConfig, _prompt_ids, stop_ids
from train.regenerate import RegenConfig, select

ROOT = Path(__file__).resolve().parents[1]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--baseline", metavar="REV", help="also time train/distill.py (+ kv_cache.py) as of this revision")
    return p.parse_args()


def sample_at(rev: str):
    """sample() as of git revision rev, with the kv_cache.py of that revision (today's heads/ and train/ else)."""
    modules = {}
    for name in ("kv_cache", "distill"):
        source = subprocess.run(["git", "show", f"{rev}:train/{name}.py"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout
        source = source.replace("from train.kv_cache import", f"from train_kv_cache_{rev} import")
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(f"train_{name}_{rev}", loader=None))
        sys.modules[module.__name__] = module
        exec(compile(source, f"{rev}:train/{name}.py", "exec"), module.__dict__)
        modules[name] = module
    return modules["distill"].sample


class ForwardClock:
    """CPU seconds spent in the model's forward, split into prefill (several tokens) and decode (one per row)."""

    def __init__(self, model):
        self.forward, self.spent = model.forward, {}
        model.forward = self

    def __call__(self, *args, **kwargs):
        kind = "prefill" if kwargs["input_ids"].shape[1] > 1 else "decode"
        c0 = time.process_time()
        out = self.forward(*args, **kwargs)
        self.spent[kind] = self.spent.get(kind, 0.0) + time.process_time() - c0
        return out


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    records = select(RegenConfig(files=sorted(glob.glob(str(shared_dir() / "data" / "train" / "*.jsonl"))),
                                 exclude_files=[str(shared_dir() / "data" / "eval" / "spec_bench" / "question.jsonl")],
                                 max_records=args.records))
    prompts = [_prompt_ids(r, target.tokenizer) for r in records]
    cfg = DistillConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, batch_size=args.batch_size)
    methods = {f"sample @ {args.baseline}": sample_at(args.baseline)} if args.baseline else {}
    methods["sample (this tree)"] = distill.sample
    clock = ForwardClock(target.model)
    answers, best = {}, {}
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens (longest {max(map(len, prompts))}), "
          f"batch {args.batch_size}, {args.threads} threads, load {open('/proc/loadavg').read().split()[:3]}")
    for rnd in range(args.rounds):
        for name, fn in methods.items():
            clock.spent = {}
            w0, c0 = time.perf_counter(), time.process_time()
            tokens, _ = fn(target.model, prompts, cfg, stop_ids(target), target.tokenizer.pad_token_id)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            n = sum(map(len, tokens))
            answers[name] = tokens
            best[name] = max(best.get(name, (0, 0)), (n / wall, n / cpu))
            split = ", ".join(f"{k} {v:.0f}" for k, v in clock.spent.items())
            print(f"round {rnd} {name}: {n} answer tokens, {n / wall:.1f} tok/s wall, {n / cpu:.1f} tok/CPU-s "
                  f"(CPU-s: {split}, other {cpu - sum(clock.spent.values()):.0f})", flush=True)
    if args.baseline:
        (old, old_best), (new, new_best) = [(answers[k], best[k]) for k in methods]
        differ = [i for i in range(len(prompts)) if old[i] != new[i]]
        print(f"best of {args.rounds}: {new_best[0] / old_best[0]:.2f}x wall, {new_best[1] / old_best[1]:.2f}x per "
              f"CPU-second; {len(differ)} of {len(prompts)} answers differ")
        for i in differ:
            at = next((j for j, (a, b) in enumerate(zip(old[i], new[i])) if a != b), min(len(old[i]), len(new[i])))
            print(f"  prompt {i} ({len(prompts[i])} tokens): first differs at answer token {at} "
                  f"({len(old[i])} vs {len(new[i])} tokens)")


if __name__ == "__main__":
    main()
