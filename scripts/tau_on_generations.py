"""τ predicted from α on the very text serve/ decoded, beside the τ serve/ measured on it.

    python scripts/tau_on_generations.py runs/serve-check [--out runs/serve-check/tau_check.json]

Reads a serve/ run directory (bench.json's settings: target, head, temperature, sampling, γ; generations.jsonl:
each answered turn's prompt_ids + token_ids) and walks train/acceptance.py's chain over each answer with that head, at
that temperature: α per draft position and τ predicted for the run's γ. At T = 0 on the runner's own greedy text the
walk's rounds are the runner's passes, so the two τ differ only by the tokens a last round emits past
``max_new_tokens``, which bench.json counts. A gap larger than that says the runner and the α measurement disagree;
a gap between this and a training run's ``tau_predicted`` says the texts differ (docs/serving.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heads.checkpoint import load_head  # noqa: E402
from heads.target import load_target  # noqa: E402
from train.acceptance import measure  # noqa: E402
from train.data import ids_example  # noqa: E402


@torch.no_grad()
def walk(run: Path, target_path: str | None = None) -> dict:
    bench = json.loads((run / "bench.json").read_text())
    s = bench["settings"]
    if not s.get("head_path") or not s.get("gamma") or s.get("tree") or bench.get("adaptive_rounds"):
        sys.exit(f"error: {run} decoded without a head or a fixed chain (gamma={s.get('gamma')}, tree={s.get('tree')})"
                 "; the walk predicts a chain: run serve/ with head_path=, gamma=N and tree=null")
    target = load_target(s["target"], target_path)
    head, _ = load_head(s["head_path"])
    head.attach_target(target)
    lines = (run / "generations.jsonl").read_text().splitlines()

    def batches():  # one answered turn at a time, whole: no max_len cut, no padding
        for line in tqdm(lines, desc="answers"):
            g = json.loads(line)
            ex = ids_example(g["prompt_ids"], g["token_ids"], len(g["prompt_ids"]) + len(g["token_ids"]))
            yield {"input_ids": ex.input_ids[None], "loss_mask": ex.loss_mask[None],
                   "attention_mask": torch.ones_like(ex.input_ids)[None]}

    tally = measure({"head": head}, target, batches(), [s["temperature"]], s["top_k"], s["top_p"],
                    raw=True)["head"][s["temperature"]]
    summary = tally.summary()
    gamma = min(int(s["gamma"]), head.num_steps)
    return {"run": str(run), "head_path": s["head_path"], "temperature": s["temperature"], "gamma": gamma,
            "answers": len(lines), "tokens": tally.tokens, "alpha": summary["alpha"],
            "tau_predicted": summary["tau_predicted"][gamma], "tau_measured": bench["tau_measured"],
            "target_passes": bench["target_passes"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a serve/ output directory (bench.json, generations.jsonl)")
    p.add_argument("--target-path", default=None, help="the target's directory, if not its conf name's default")
    p.add_argument("--out", type=Path, default=None, help="default: RUN/tau_check.json")
    args = p.parse_args()
    result = walk(args.run, args.target_path)
    (args.out or args.run / "tau_check.json").write_text(json.dumps(result, indent=2))
    alpha = " / ".join(f"{a:.3f}" for a in result["alpha"])
    print(f"| answers | tokens | α per position | τ(γ = {result['gamma']}) predicted | τ measured |")
    print("|---:|---:|---|---:|---:|")
    print(f"| {result['answers']} | {result['tokens']} | {alpha} | {result['tau_predicted']:.3f} | "
          f"{result['tau_measured']:.3f} |")


if __name__ == "__main__":
    main()
