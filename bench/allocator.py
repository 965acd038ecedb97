"""Training throughput under three CPU memory-allocator settings: glibc's defaults, glibc keeping freed memory, and
PyTorch's tensors on transparent huge pages.

    python -m bench allocator                                    # EAGLE-3 on SmolLM2-135M, the recipes' batch shape
    python -m bench allocator head=medusa --reps 3               # extra overrides for every run

Why: a training step allocates its large activations and logits afresh every step. glibc serves every block over its
mmap threshold (32 MiB at most, by default) with a fresh mmap and unmaps it on free, so the kernel faults the same
memory in again 4 KiB at a time, step after step: the EAGLE-1 recipe spent 20% of its CPU time in the kernel (678M
minor faults), Medusa's 41% (docs/results/training-and-scaling.md). The arms:
- ``glibc``: glibc's defaults (``keep_freed_memory=false``);
- ``keep``: ``keep_freed_memory=true`` (train/trainer.py): mmap and trim thresholds at 2 GiB through mallopt, so big
  blocks come from the heap and stay there once freed, and later steps reuse pages that are already mapped; the
  heap's free pages go back every 25 steps (malloc_trim), since kept memory alone grows run-long;
- ``thp``: glibc's defaults with THP_MEM_ALLOC_ENABLE=1: PyTorch aligns blocks of 2 MiB and more to 2 MiB and asks
  the kernel for huge pages (512 times fewer faults, each zeroing 2 MiB).
PyTorch reads its variable at the first allocation, so each arm is its own ``train/main.py`` process, its
environment without the variable but for the ``thp`` arm. Arms interleave after one untimed
run that builds the feature cache they all read. Writes trained tokens/s (training steps only; the best of --reps)
and the process's user and system CPU seconds, minor page faults and peak RSS (whole run) to OUT/allocator.json and
OUT/allocator.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import common

BASE = ["logger=none", "trainer.max_steps=60", "trainer.enable_progress_bar=false", "data.respond=dataset",
        "data.train_files=[${shared:data/train/dolly_sample.jsonl}]", "data.max_eval_records=4",
        "eval.extra_temperatures=[]", "data.batch_size=8", "data.max_len=512", "data.cache_features=true",
        "data.features_on_disk=true", "trainer.precision=bf16-if-native", "seed=0"]
ARMS = {  # name -> (environment variables, train/main.py overrides)
    "glibc": ({}, ["keep_freed_memory=false"]),
    "keep": ({}, ["keep_freed_memory=true"]),
    "thp": ({"THP_MEM_ALLOC_ENABLE": "1"}, ["keep_freed_memory=false"]),
}


def add_arguments(p) -> None:
    common.add_common(p, "out", "reps", out="allocator_out")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("overrides", nargs="*", help="train/main.py overrides for every run (head=eagle ...)")


def run(out: Path, arm: tuple[dict, list[str]], overrides: list[str]) -> dict:
    """One training process under ``arm``: its acceptance record's tokens/s and its own rusage."""
    env, extra = arm
    env = {**{k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}, **env}
    proc = subprocess.Popen([sys.executable, str(common.ROOT / "train" / "main.py"), *overrides, *extra,
                             f"hydra.run.dir={out}"], env=env, cwd=common.ROOT, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), proc.args)
    record = json.loads((out / "acceptance.json").read_text())
    return {"trained_tokens_per_s": record["trained_tokens_per_s"], "user_s": usage.ru_utime,
            "system_s": usage.ru_stime, "minor_faults": usage.ru_minflt, "peak_rss_gib": usage.ru_maxrss / 2**20}


def main(args):
    out = common.start(args, "allocator")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp_mode = thp.read_text().strip() if thp.exists() else "absent"
    runs = {name: [] for name in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        overrides = [*BASE, f"data.feature_dir={tmp / 'feats'}", *args.overrides]
        run(tmp / "warm-up", ARMS["glibc"], overrides)  # builds the feature cache (and warms the page cache) for every arm
        for i in range(args.reps):
            for name in args.arms:
                r = run(tmp / f"{name}-{i}", ARMS[name], overrides)
                runs[name].append(r)
                print(f"{name} #{i}: {r['trained_tokens_per_s']:.0f} trained tokens/s, user {r['user_s']:.0f} s, "
                      f"system {r['system_s']:.0f} s, {r['minor_faults'] / 1e6:.1f}M minor faults, "
                      f"peak RSS {r['peak_rss_gib']:.1f} GiB", flush=True)
    best = {name: max(rs, key=lambda r: r["trained_tokens_per_s"]) for name, rs in runs.items()}
    first = best[args.arms[0]]["trained_tokens_per_s"]
    report = common.record(overrides=[*BASE, *args.overrides], thp_mode=thp_mode, reps=args.reps,
                           arms={name: {"environment": ARMS[name][0], "overrides": ARMS[name][1]}
                                 for name in args.arms}, runs=runs, best=best,
                           over_first={name: r["trained_tokens_per_s"] / first for name, r in best.items()})
    common.write(out, "allocator", report, markdown(report))


def markdown(report: dict) -> str:
    lines = common.header(report, "Training under three memory-allocator settings",
                          f"kernel THP: {report['thp_mode']} · best of {report['reps']}")
    first = next(iter(report["best"]))
    lines += [f"| arm | setting | trained tokens/s | ÷ {first} | user CPU s | system CPU s | minor faults | "
              "peak RSS GiB |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in report["best"].items():
        arm = report["arms"][name]
        env = " ".join([*(f"{k}={v}" for k, v in arm["environment"].items()), *arm["overrides"]])
        lines.append(f"| {name} | `{env}` | {r['trained_tokens_per_s']:.0f} | {report['over_first'][name]:.2f}× | "
                     f"{r['user_s']:.0f} | {r['system_s']:.0f} | {r['minor_faults'] / 1e6:.1f}M | "
                     f"{r['peak_rss_gib']:.1f} |")
    return "\n".join(lines + [""])
