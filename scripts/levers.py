"""α per CPU-minute, one lever at a time: each arm is the base job plus one change, on one fixed held-out set.

    python scripts/levers.py --out runs/levers                       # every arm of ARMS, in order
    python scripts/levers.py --out runs/levers --arms base loss-lk   # some of them (finished arms are kept)
    python scripts/levers.py --out runs/levers --base experiment=smollm2-eagle3 trainer.max_steps=300

The base is the default job (`python train/main.py`: EAGLE-3 on SmolLM2-135M, its self-distilled seed prompts)
measured on Spec-Bench's 52 prompts (4 per category; validation picks the kept head, the test half is reported),
so every arm is measured on the same held-out greedy answers. Before the arms, one warm-up run answers the training
and held-out prompts into the study's cache (OUT/cache), so no arm pays for answering in its run; instead each
arm is charged what its training text cost to write (acceptance.json's training_text_cost, measured once when the
answers were made), and the held-out answers are charged to no arm. An arm's CPU-minutes are its process tree's
user + system time (getrusage) plus that text cost.

An arm whose held-out prompts differ from the table's is refused (its α would not be comparable). Each arm's run
directory is OUT/ARM; a finished arm (its row in OUT/levers.json) is not run again, so a killed study resumes.
Writes OUT/levers.json, OUT/levers.md (Δα₁ and ΔCPU-minutes against the base; machine, commit, commands) and
OUT/levers.png (α₁ against CPU-minutes).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.common import machine

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = "data.eval_files=[${shared:data/eval/spec_bench/question.jsonl}]"
BASE = [SPEC_BENCH, "data.max_eval_records=52", "logger=csv", "eval.extra_temperatures=[]"]
# name -> (the lever, its overrides on top of the base). The text arms change what answering costs, which is charged.
ARMS = {
    "base": ("today's default job", []),
    "base-seed1": ("the base with another seed: the noise floor", ["seed=1"]),
    "loss-tv": ("loss: TV (1 - α) in place of soft CE", ["head.loss.kind=tv"]),
    "loss-lk": ("loss: LK hybrid λ·KL + (1-λ)·TV, λ = exp(-3α)", ["head.loss.kind=lk"]),
    "eagle3.1": ("EAGLE 3.1 normalisation (fc_norm, norm_output; a base from before SmolLM2 defaulted to it)",
                 ["head.hparams.fc_norm=true", "head.hparams.norm_output=true"]),
    "eagle3.0": ("EAGLE-3 without 3.1's normalisation (SmolLM2's base has it since it won)",
                 ["head.hparams.fc_norm=false", "head.hparams.norm_output=false"]),
    # optim.name=auto is Muon (AdamW only under DeepSpeed): the muon arm is a lever for a base pinned to AdamW
    "muon": ("Muon on the hidden matrices (a base with optim.name=adamw)", ["optim.name=muon"]),
    "adamw": ("AdamW in place of Muon", ["optim.name=adamw"]),
    "one-pass": ("3x the answers (6 per prompt) in the base's steps: one pass at 180 steps, in place of ~3 epochs",
                 ["data.distill.samples_per_prompt=6"]),
    "steps-2x": ("360 steps over the same answers, ~7 epochs (EAGLE-3's default since it won; the others' is 180)",
                 ["trainer.max_steps=360"]),
    "reference-text": ("training text: the datasets' reference answers, no answering cost (270 steps: 180's tokens)",
                       ["data.train_files=[]", "data.reference_files=[${shared:data/train/*.jsonl}]",
                        "data.max_reference_records=2000", "trainer.max_steps=270"]),
    "greedy-text": ("training text: greedy answers (1 per prompt) in place of 2 sampled at T=0.7",
                    ["data.distill.temperature=0", "data.distill.samples_per_prompt=1"]),
    "bf16": ("bf16-mixed training; the feature pass stays float32 (CPUs with AMX or AVX512-BF16 only)",
             ["trainer.precision=bf16-if-native"]),
}
# Arms that mean nothing on some machines: bf16-if-native is fp32 (the base again) on a CPU without bf16 units.
NEEDS_BF16_UNITS = {"bf16"}


class Refused(Exception):
    """An arm that cannot join the table (one line: what differs and what to do)."""


def commit() -> str:
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = run("status", "--porcelain", "--", "heads", "train", "conf", "scripts/levers.py")
    return run("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def check_machine(name: str, m: dict) -> None:
    """Refuse an arm this machine cannot measure (it would rerun the base under another name)."""
    if name in NEEDS_BF16_UNITS and not {"avx512_bf16", "amx_bf16"} & set(m["cpu_units"]):
        raise Refused(f"arm {name} needs a CPU with AMX or AVX512-BF16 (this one has "
                      f"{', '.join(m['cpu_units']) or 'neither'}); drop it from --arms")


def heldout_digest(record: dict) -> str:
    """What α was measured on: the held-out prompts of both splits, as one hash."""
    keys = record.get("heldout_prompt_keys")
    if not keys:
        raise Refused("acceptance.json has no heldout_prompt_keys (written by train/main.py since the split)")
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def text_cpu_seconds(record: dict, run_start: float, cache: Path) -> float:
    """CPU seconds the arm's training text cost to write, when it was written before the arm ran (the arm's own
    getrusage holds answering it did itself)."""
    total = 0.0
    for cost in record.get("training_text_cost", []):
        made = cache / "data" / Path(cost["file"]).with_suffix(".cost.json").name
        if cost.get("unknown"):
            raise Refused(f"the training text {cost['file']} has no recorded cost; delete it from {cache}/data")
        if not made.exists() or made.stat().st_mtime < run_start:
            total += float(cost["cpu_seconds"])
    return total


def row(name: str, lever: str, overrides: list[str], record: dict, cpu_run: float, text_cpu: float,
        wall: float) -> dict:
    test = record["test"]
    return {"arm": name, "lever": lever, "overrides": overrides, "heldout": heldout_digest(record),
            "alpha_test": [round(a, 4) for a in test["alpha"]],
            "tau_test": round(test["tau_predicted"][str(len(test["alpha"]))], 4),  # γ = K, keys as JSON wrote them
            "test_tokens": test["num_tokens"], "alpha_validation": [round(a, 4) for a in record["alpha"]],
            "trained_tokens": record["trained_tokens"], "train_steps": record["train_steps"],
            "cpu_minutes": round((cpu_run + text_cpu) / 60, 2), "cpu_minutes_run": round(cpu_run / 60, 2),
            "cpu_minutes_text": round(text_cpu / 60, 2), "wall_minutes": round(wall / 60, 2)}


def add(table: dict, entry: dict) -> None:
    """Put an arm in the table, refusing one measured on other held-out prompts than the table's."""
    want = table.setdefault("heldout", entry["heldout"])
    if entry["heldout"] != want:
        raise Refused(f"arm {entry['arm']} measured α on other held-out prompts ({entry['heldout']}) than the "
                      f"table ({want}); run it with the table's base overrides, or start a new --out")
    table["arms"][entry["arm"]] = entry


def markdown(table: dict) -> str:
    base = table["arms"].get("base")
    lines = [f"# Levers: α per CPU-minute ({table['date']})", "",
             f"Machine: {table['machine']['cpu']} ({', '.join(table['machine']['cpu_units'])}), "
             f"{table['machine']['cores']} cores, {table['threads']} threads; commit `{table['commit']}`.",
             f"Base: `python train/main.py {' '.join(table['base'])}`; held-out set {table.get('heldout')} "
             f"(Spec-Bench test split, T = 0). CPU-minutes = the run's user + system time + its training text's "
             f"answering (the held-out answers are charged to no arm).", "",
             "| arm | lever | α per position (test) | Δα₁ | τ(γ=K) | CPU-min (run + text; Δ) | trained tokens | "
             "overrides |", "|---|---|---|---:|---:|---:|---:|---|"]
    for e in table["arms"].values():
        d = e["alpha_test"][0] - base["alpha_test"][0] if base else float("nan")
        dc = e["cpu_minutes"] - base["cpu_minutes"] if base else float("nan")
        lines.append(f"| {e['arm']} | {e['lever']} | {' / '.join(f'{a:.3f}' for a in e['alpha_test'])} | "
                     f"{d:+.3f} | {e['tau_test']:.2f} | {e['cpu_minutes']:.1f} ({e['cpu_minutes_run']:.1f} + "
                     f"{e['cpu_minutes_text']:.1f}; {dc:+.1f}) | {e['trained_tokens']:,} | "
                     f"`{' '.join(e['overrides'])}` |")
    return "\n".join(lines) + "\n"


def plot(table: dict, path: Path) -> None:
    """α₁ (test) against CPU-minutes, one point per arm: up-left of the base is a better recipe per CPU-minute."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e in table["arms"].values():
        ax.scatter(e["cpu_minutes"], e["alpha_test"][0], color="C3" if e["arm"].startswith("base") else "C0")
        ax.annotate(e["arm"], (e["cpu_minutes"], e["alpha_test"][0]), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("CPU-minutes (run + training text)")
    ax.set_ylabel("α₁, Spec-Bench test split, T = 0")
    ax.set_title(f"One lever at a time ({table['machine']['cpu']}, {table['date']})", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_arm(out: Path, name: str, overrides: list[str], base: list[str], env: dict, threads: int) -> tuple:
    """train/main.py in a subprocess; returns (acceptance record, its CPU seconds, wall seconds, start time)."""
    cmd = [sys.executable, str(ROOT / "train/main.py"), *base, *overrides, f"hydra.run.dir={out / name}"]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    print(f"levers: {name}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": str(threads)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise Refused(f"arm {name} failed (exit {proc.returncode}); its log is in {out / name}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads((out / name / "acceptance.json").read_text()), cpu, time.time() - start, start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--base", nargs="*", default=[], help="train/main.py overrides under every arm (the base job)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", default=None, help="DRAFTHEADS_CACHE for the study (default OUT/cache)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache or out / "cache").resolve()
    env = {**os.environ, "DRAFTHEADS_CACHE": str(cache), "WANDB_MODE": "offline"}
    base = BASE + args.base
    path = out / "levers.json"
    table = json.loads(path.read_text()) if path.exists() else {"arms": {}}
    if table.get("base", base) != base:
        sys.exit(f"error: {out} holds a study of base {table['base']}; pass those --base overrides or a new --out")
    table.update(base=base, threads=args.threads, machine=machine(), commit=commit(),
                 date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    try:
        if not (out / "warmup" / "acceptance.json").exists():  # answers every text into the cache, charged to none
            run_arm(out, "warmup", ["trainer.max_steps=1", "trainer.val_check_interval=1"], base, env, args.threads)
        for name in args.arms:
            if name in table["arms"]:
                print(f"levers: {name}: done before, kept", flush=True)
                continue
            lever, overrides = ARMS[name]
            check_machine(name, table["machine"])
            record, cpu, wall, start = run_arm(out, name, overrides, base, env, args.threads)
            add(table, row(name, lever, overrides, record, cpu, text_cpu_seconds(record, start, cache), wall))
            path.write_text(json.dumps(table, indent=1))
            (out / "levers.md").write_text(markdown(table))
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if table["arms"]:
        plot(table, out / "levers.png")
    print(markdown(table))


if __name__ == "__main__":
    main()
