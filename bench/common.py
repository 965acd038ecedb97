"""What every benchmark shares: its arguments, the machine record, the target and its prompts, interleaved timing, and
the writer that puts a JSON result beside its markdown table.

Timings on a shared machine move with its load, so every subcommand interleaves its methods (each round runs all of
them) and keeps the best of its repetitions; the record names the CPU, its vector units and the load average, so a
figure can be read against the machine it came from.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The arguments most subcommands take, one definition each; a subcommand asks for the ones it reads and may change
# their default (add_common(p, "target", "reps", reps=7)).
COMMON = {
    "target": dict(default="smollm2-135m", help="a target name from conf/target or a model dir"),
    "out": dict(default=None, help="output dir (default: SUBCOMMAND_out)"),
    "threads": dict(type=int, default=None, help="torch threads (default: torch's choice)"),
    "reps": dict(type=int, default=2, help="repetitions per method; the fastest counts"),
    "max-new-tokens": dict(type=int, default=128, help="tokens decoded per prompt"),
    "compile": dict(action="store_true", help="the runner's target under torch.compile (serve compile=true)"),
    "prompts": dict(default=None, help="a Spec-Bench-style jsonl (default: ../shared/data/eval/spec_bench)"),
    "split": dict(default="test", choices=["test", "validation", "all"],
                  help="which half of the prompts (heads/splits.py): α and calibration use validation"),
    "per-task": dict(type=int, default=None, help="at most N prompts per Spec-Bench task"),
    "limit": dict(type=int, default=None, help="at most N prompts in all"),
    "temperatures": dict(type=float, nargs="+", default=[0.0, 1.0]),
}


def add_common(p: argparse.ArgumentParser, *names: str, **defaults) -> None:
    for name in names:
        spec = dict(COMMON[name])
        key = name.replace("-", "_")
        if key in defaults:
            spec["default"] = defaults[key]
        p.add_argument(f"--{name}", **spec)


def cpu_name() -> str:
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_units() -> list[str]:
    """The vector and matrix units that decide CPU speed and what bf16 costs (AVX2, AVX-512 BF16, AMX)."""
    if not Path("/proc/cpuinfo").exists():
        return []
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]


def machine() -> dict:
    """The record every result carries: CPU and its units, cores, threads, load, torch, GPU."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "cpu": cpu_name(), "cpu_units": cpu_units(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "load_average": [round(x, 2) for x in load] if load else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def machine_line(m: dict) -> str:
    """One line for a table's header: CPU (units) · threads · load · torch · GPU."""
    units = f" ({', '.join(m['cpu_units'])})" if m.get("cpu_units") else ""
    load = f" · load {m['load_average'][0]}" if m.get("load_average") else ""
    gpu = f" · {m['gpu']}" if m.get("gpu") else ""
    return f"{m['cpu']}{units} · {m['threads']} threads{load} · torch {m['torch']}{gpu}"


def start(args, name: str) -> Path:
    """Apply --threads, make the output dir and return it."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    out = Path(getattr(args, "out", None) or f"{name.replace('-', '_')}_out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def record(**fields) -> dict:
    """A result's common head: date, machine, the command that reproduces it, then the subcommand's fields."""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "command": "python -m bench " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("__main__.py")
            else " ".join(sys.argv), **fields}


def header(report: dict, title: str, details: str = "") -> list[str]:
    """A table's first lines: title, date · machine · details, and the command."""
    line = f"{report['date']} · {machine_line(report['machine'])}" + (f" · {details}" if details else "")
    return [f"# {title}", "", line, "", f"`{report['command']}`", ""]


def write(out: Path, stem: str, report: dict, markdown: str | None = None) -> None:
    """OUT/STEM.json (atomically: a kill mid-write leaves the previous file) and OUT/STEM.md beside it; prints the
    table."""
    tmp = out / f"{stem}.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / f"{stem}.json")
    if markdown is not None:
        (out / f"{stem}.md").write_text(markdown)
        print(markdown)


def load_runner(args):
    """(target, serve/'s Transformer over its weights, device): bf16 on a GPU, fp32 on CPU; compiled on --compile."""
    import torch

    from heads.target import load_target
    from serve.model import Transformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(args.target, dtype="bfloat16" if device == "cuda" else "float32", device=device)
    model = Transformer.from_hf(target.model)  # shares the HF model's weights
    if getattr(args, "compile", False):
        model.compile()
    return target, model, device


def spec_bench(args, tokenizer, chat_template: bool = True) -> list[dict]:
    """The prompts --prompts/--split/--per-task/--limit select (serve.prompts.load_prompts records)."""
    from heads.target import shared_dir
    from serve.prompts import load_prompts

    path = args.prompts or str(shared_dir() / "data/eval/spec_bench/question.jsonl")
    return load_prompts(path, tokenizer, chat_template, args.per_task, args.limit,
                        None if args.split == "all" else args.split)


def best_of(methods: dict, items, reps: int, between=None) -> dict:
    """{method: {item: best seconds}}: every method runs every item once per round, methods interleaved so load on
    the machine hits all alike, one untimed warm-up first; ``between()`` runs after each round (an outside engine's
    repetition, so it meets the same load)."""
    from tqdm import tqdm

    best = {name: {i: float("inf") for i in items} for name in methods}
    for fn in methods.values():
        for i in items:
            fn(i)
    for _ in tqdm(range(reps), desc="rounds", leave=False):
        for name, fn in methods.items():
            for i in items:
                t0 = time.perf_counter()
                fn(i)
                best[name][i] = min(best[name][i], time.perf_counter() - t0)
        if between is not None:
            between()
    return best
