"""Training throughput with the target online versus from the disk feature cache, on the same data and seed.

    OMP_NUM_THREADS=1 python -m bench feature-cache                              # SmolLM2-135M, EAGLE-3
    python -m bench feature-cache head=medusa trainer.max_steps=40               # extra overrides for every run

Three runs: online (a target pass per step), cache build + train (first run), cache reuse + train (the case every
later head pays). Writes trained tokens/s (training steps only), wall time, α₁ and bytes per cached token to
OUT/feature_cache.json and OUT/feature_cache.md.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import common

BASE = ["logger=none", "trainer.max_steps=20", "trainer.enable_progress_bar=false", "data.respond=dataset",
        "data.train_files=[${shared:data/train/dolly_sample.jsonl}]", "data.max_eval_records=4",
        "eval.extra_temperatures=[]", "data.batch_size=8", "seed=0"]


def add_arguments(p) -> None:
    common.add_common(p, "threads", "out", out="feature_cache_out")
    p.add_argument("overrides", nargs="*", help="train/main.py overrides for every run (head=medusa ...)")


def run(out: Path, *overrides: str) -> tuple[dict, float]:
    from hydra import compose, initialize_config_dir

    import train.main as job

    with initialize_config_dir(config_dir=str(common.ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"out_dir={out}", *overrides])
    t0 = time.perf_counter()
    record = job.run(cfg)
    return record, time.perf_counter() - t0


def main(args):
    out = common.start(args, "feature_cache")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        disk = ("data.cache_features=true", "data.features_on_disk=true", f"data.feature_dir={tmp / 'feats'}")
        for name, extra in (("online", ("data.cache_features=false",)), ("cache build", disk), ("cache reuse", disk)):
            record, wall = run(tmp / name.replace(" ", "_"), *BASE, *args.overrides, *extra)
            rows.append({"run": name, "trained_tokens_per_s": record["trained_tokens_per_s"], "wall_s": wall,
                         "alpha_1": record["alpha"][0], "feature_cache": record.get("feature_cache")})
            print(f"{name}: {record['trained_tokens_per_s']:.0f} trained tokens/s, {wall:.0f} s", flush=True)
    report = common.record(overrides=[*BASE, *args.overrides], rows=rows,
                           reuse_over_online=rows[2]["trained_tokens_per_s"] / rows[0]["trained_tokens_per_s"])
    common.write(out, "feature_cache", report, markdown(report))


def markdown(report: dict) -> str:
    info = report["rows"][2]["feature_cache"] or {}
    lines = common.header(report, "Training from the feature cache", "same data and seed in every run")
    lines += ["| run | trained tokens/s | wall s | α₁ |", "|---|---:|---:|---:|"]
    lines += [f"| {r['run']} | {r['trained_tokens_per_s']:.0f} | {r['wall_s']:.0f} | {r['alpha_1']:.3f} |"
              for r in report["rows"]]
    lines += ["", f"Cache: {info.get('bytes_per_token')} bytes/token ({len(info.get('layers', []))} layers), "
              f"{info.get('tokens')} tokens; reuse ÷ online trained tokens/s = {report['reuse_over_online']:.1f}×.",
              ""]
    return "\n".join(lines)
