"""Training throughput with the target online versus from the disk feature cache, on the same data and seed.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/feature_cache_bench.py            # SmolLM2-135M, EAGLE-3
    python scripts/feature_cache_bench.py head=medusa trainer.max_steps=40          # extra overrides for every run

Three runs: online (a target pass per step), cache build + train (first run), cache reuse + train (the case every
later head pays). Prints trained tokens/s (training steps only), wall time and bytes per cached token.
"""
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import train.main as job

CONF = Path(__file__).resolve().parent.parent / "conf"
BASE = ["logger=none", "trainer.max_steps=20", "trainer.enable_progress_bar=false", "data.respond=dataset",
        "data.train_files=[${shared:data/train/dolly_sample.jsonl}]", "data.max_eval_records=4",
        "eval.extra_temperatures=[]", "data.batch_size=8", "seed=0"]


def run(out: Path, *overrides: str) -> tuple[dict, float]:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=[f"out_dir={out}", *BASE, *sys.argv[1:], *overrides])
    t0 = time.perf_counter()
    record = job.run(cfg)
    return record, time.perf_counter() - t0


print(f"{'run':12} {'trained tok/s':>14} {'wall s':>8} {'α1':>6}", flush=True)
rows = []
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    disk = ("data.cache_features=true", "data.features_on_disk=true", f"data.feature_dir={tmp / 'feats'}")
    for name, overrides in (("online", ("data.cache_features=false",)), ("cache build", disk), ("cache reuse", disk)):
        record, wall = run(tmp / name.replace(" ", "_"), *overrides)
        rows.append(record)
        print(f"{name:12} {record['trained_tokens_per_s']:14.0f} {wall:8.0f} {record['alpha'][0]:6.3f}", flush=True)
info = rows[2]["feature_cache"]
print(f"cache: {info['bytes_per_token']} bytes/token ({len(info['layers'])} layers), {info['tokens']} tokens; "
      f"reuse/online trained tokens/s = {rows[2]['trained_tokens_per_s'] / rows[0]['trained_tokens_per_s']:.1f}x")
