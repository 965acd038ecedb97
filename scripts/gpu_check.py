"""GPU check, one command, under 10 minutes on one modern GPU: the CUDA paths the CPU tests cannot reach.

    python scripts/gpu_check.py --out runs/gpu-check            # add --steps 100 for a shorter run

1. Trains an EAGLE-3 head on SmolLM2-135M on CUDA with the default trainer (no override: bf16-mixed, the target
   loaded onto the GPU in bf16), on one device; with several GPUs, also `trainer=ddp` and
   `trainer=deepspeed_zero2` on two.
2. Runs serve/ on CUDA with that head (gamma=auto, which measures the costs below) and without (vanilla), and
   reports the verify-pass cost r(γ+1) in units of one decode step, a draft step's cost c, and the runner's
   overhead per round: measured seconds per round minus (r(γ+1) + γ·c) decode steps.
Without CUDA it says so in one line and exits 2: nothing is run. Everything lands in --out (summary.json too).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], log: Path, timeout: int) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(args)}; see {log}")
    return time.perf_counter() - t0


def train(out: Path, name: str, steps: int, extra: list[str]) -> dict:
    seconds = run(["train/main.py", "head=eagle3", "logger=csv", f"trainer.max_steps={steps}",
                   "trainer.enable_progress_bar=false", f"hydra.run.dir={out / name}", *extra],
                  out / f"{name}.log", timeout=420)
    record = json.loads((out / name / "acceptance.json").read_text())
    return {"seconds": round(seconds, 1), "alpha": [round(a, 3) for a in record["alpha"]],
            "alpha_untrained": [round(a, 3) for a in record["alpha_untrained"]], "steps": record["train_steps"]}


def serve(out: Path, name: str, extra: list[str]) -> dict:
    run(["serve/main.py", "target=smollm2-135m", "temperature=0", "max_new_tokens=128", "per_category=1",
         "progress=false", f"hydra.run.dir={out / name}", *extra], out / f"{name}.log", timeout=300)
    return json.loads((out / name / "bench.json").read_text())


def tokens(run_dir: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in (run_dir / "generations.jsonl").open()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/gpu-check")
    ap.add_argument("--steps", type=int, default=200, help="training steps on one GPU (the multi-GPU runs do 50)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device, so nothing was run; run it on a machine with a GPU "
              "(and a CUDA build of torch)", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = torch.cuda.device_count()
    summary = {"gpu": torch.cuda.get_device_name(), "gpus": n, "torch": torch.__version__,
               "bf16": torch.cuda.is_bf16_supported(), "train": {}}
    summary["train"]["one_gpu"] = train(out, "one_gpu", args.steps, ["trainer.devices=1"])
    if n >= 2:
        for strategy in ("ddp", "deepspeed_zero2"):
            summary["train"][strategy] = train(out, strategy, 50, [f"trainer={strategy}", "trainer.devices=2"])
    head = out / "one_gpu"
    spec = serve(out, "serve_head", [f"head_path={head}", "gamma=auto"])
    vanilla = serve(out, "serve_vanilla", [])
    costs, gamma = spec["auto"]["costs"], spec["settings"].get("gamma") or 0
    rounds = spec["target_passes"] - spec["prefill_passes"]
    one = costs["target_pass_1_s"]
    r_verify = {int(k): v for k, v in costs["r"].items()}.get(gamma + 1, 1.0)  # JSON keys are strings
    predicted_round = (r_verify + gamma * costs.get("c", 0)) * one
    round_s = spec["seconds"] / max(rounds, 1)
    summary["serve"] = {
        "gamma": gamma, "r_verify": r_verify, "r": costs["r"], "c": costs.get("c"),
        "decode_step_ms": round(1e3 * one, 3), "round_ms": round(1e3 * round_s, 3),
        "runner_overhead_per_round_ms": round(1e3 * (round_s - predicted_round), 3),
        "tau_measured": spec["tau_measured"], "tokens_per_s": spec["tokens_per_s"],
        "vanilla_tokens_per_s": vanilla["tokens_per_s"],
        "vanilla_overhead_per_token_ms": round(1e3 * (vanilla["seconds"] / max(vanilla["new_tokens"], 1) - one), 3),
        # bf16 verification of γ+1 tokens rounds differently from one-token steps: near-ties may flip
        "greedy_equal_to_vanilla": tokens(out / "serve_head") == tokens(out / "serve_vanilla"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
