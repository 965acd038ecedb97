"""α per draft position against trained tokens, from the mid-run checks of one or more training runs.

    python scripts/scaling_curve.py runs/eagle3-r1 [runs/eagle3-r2 ...] [--out docs/scaling_eagle3.png]

Reads each run's CSV metrics (``logger=csv``: OUT/csv/version_*/metrics.csv, every version, so a resumed run is
one curve) and its acceptance.json. The x axis is ``val/trained_tokens``; CSVs written before that column existed
get step × (trained tokens per step from acceptance.json), marked "≈". Writes the plot (log x) and prints a
markdown table: one row per check (trained tokens, α per position, τ at γ = K when logged) and the final row of
acceptance.json (the kept head).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def read_checks(run: Path) -> tuple[list[dict], dict | None, bool]:
    """-> (checks sorted by step, acceptance.json or None, whether trained tokens were estimated)."""
    rows = [r for f in sorted(run.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
            for r in csv.DictReader(open(f))]
    record = json.loads((run / "acceptance.json").read_text()) if (run / "acceptance.json").exists() else None
    by_step: dict[int, dict] = {}
    for r in rows:
        if r.get("val/alpha@1"):
            by_step[int(r["step"])] = r  # a resumed run's later check at the same step wins
    estimated = False
    checks = []
    for step, r in sorted(by_step.items()):
        K = max(int(k.split("@")[1]) for k in r if k.startswith("val/alpha@") and r[k])
        tokens = r.get("val/trained_tokens")
        if tokens:
            tokens = float(tokens)
        elif record and record.get("train_steps"):
            per_step = record.get("trained_tokens_total", record["trained_tokens"]) / record["train_steps"]
            tokens, estimated = (step + 1) * per_step, True  # the CSV's step counts from 0
        else:
            sys.exit(f"error: {run} logs no val/trained_tokens and has no acceptance.json to estimate them from; "
                     "rerun with this version of train/ or wait for the run to finish")
        tau = r.get(f"val/tau@{K}")
        checks.append({"step": step + 1, "tokens": tokens, "alpha": [float(r[f"val/alpha@{k}"]) for k in range(1, K + 1)],
                       "tau": float(tau) if tau else None})
    return checks, record, estimated


def table(runs: dict[str, tuple]) -> str:
    K = max((len(c["alpha"]) for checks, _, _ in runs.values() for c in checks), default=3)
    head = ["run", "step", "trained tokens"] + [f"α{k}" for k in range(1, K + 1)] + [f"τ (γ={K})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, (checks, record, estimated) in runs.items():
        for c in checks:
            alphas = [f"{a:.3f}" for a in c["alpha"]] + [""] * (K - len(c["alpha"]))
            tau = f"{c['tau']:.3f}" if c["tau"] is not None else ""
            lines.append(f"| {name} | {c['step']} | {'≈' if estimated else ''}{c['tokens']:,.0f} | "
                         + " | ".join(alphas) + f" | {tau} |")
        if record:
            alphas = [f"{a:.3f}" for a in record["alpha"]] + [""] * (K - len(record["alpha"]))
            tau = record.get("tau_predicted", {}).get(str(len(record["alpha"])))
            step = record.get("head_step", record.get("train_steps"))
            tokens = next((f"{c['trained_tokens']:,.0f}" for c in record.get("heldout_checks", [])
                           if c["step"] == step), "")
            tau = f"{tau:.3f}" if tau else ""
            lines.append(f"| {name} (kept head, acceptance.json) | {step} | {tokens} | " + " | ".join(alphas)
                         + f" | {tau} |")
    return "\n".join(lines)


def plot(runs: dict[str, tuple], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--", ":", "-."]
    for i, (name, (checks, _, estimated)) in enumerate(runs.items()):
        K = max((len(c["alpha"]) for c in checks), default=0)
        for k in range(K):
            pts = [(c["tokens"], c["alpha"][k]) for c in checks if len(c["alpha"]) > k]
            ax.plot(*zip(*pts), styles[i % len(styles)], marker="o", ms=3, color=f"C{k}",
                    label=f"{name} α{k + 1}" + (" (tokens ≈)" if estimated else ""))
    ax.set_xscale("log")
    ax.set_xlabel("trained tokens")
    ax.set_ylabel("held-out α per draft position")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (hydra.run.dir) trained with logger=csv")
    p.add_argument("--out", type=Path, default=Path("docs/scaling_eagle3.png"))
    args = p.parse_args()
    runs = {}
    for run in args.runs:
        if not list(run.glob("csv/version_*/metrics.csv")):
            sys.exit(f"error: no {run}/csv/version_*/metrics.csv; train with logger=csv hydra.run.dir={run}")
        checks, record, estimated = read_checks(run)
        if not checks:
            sys.exit(f"error: {run} has no mid-run checks (val/alpha@k); train with trainer.limit_val_batches=1.0")
        runs[run.name] = (checks, record, estimated)
    plot(runs, args.out)
    print(table(runs))
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
