"""Two-process DDP and DeepSpeed ZeRO-2/3 runs of ``python train/main.py`` on CPU (gloo) match a single process.

"The same run" means the same global batch, seed and data order: the single process takes micro-batches of 4 and
accumulates 2 per step; two ranks take 4 each. The DataModule's sampler deals global batch i's micro-batches to
ranks (or accumulation slots) in the same order, and averaging two micro-batch gradients is what both accumulation
and DDP/ZeRO do, so the trained heads agree to float rounding. The loss is KL to the target (it falls to ~0; soft
CE sits on the random target's entropy) and the learning rate is high enough that 8 steps move the head a lot.

Each run is a subprocess in its own session, killed as a group on timeout: Lightning's DDP launcher re-runs the
command line for rank 1, which inside pytest would re-run pytest, and a hung rank must not outlive the test.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from heads.checkpoint import load_head
from heads.losses import head_loss
from tests.train.conftest import write_chat

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
COMMON = ["target=tiny-random", "head=eagle3", "logger=csv", "trainer.enable_progress_bar=false",
          f"trainer.max_steps={STEPS}", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
          "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=4", "data.batch_size=4",
          "data.eval_batch_size=4", "data.respond=dataset", "optim.warmup_steps=2", "optim.lr=3e-3",
          "head.loss.kind=kl"]
TWO_CPU_RANKS = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def run_job(out: Path, files: tuple[Path, Path], *overrides: str, timeout: int = 300) -> Path:
    train_file, eval_file = files
    cmd = [sys.executable, "train/main.py", *COMMON, f"data.train_files=[{train_file}]",
           f"data.eval_files=[{eval_file}]", f"hydra.run.dir={out}", *overrides]
    # One thread per process: two ranks already fill the cores, and spinning OpenMP threads slow a shared box 5x.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)  # rank 1 shares the pipe: this also waits for it
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session holds rank 0 and the rank 1 it launched
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(overrides)} timed out after {timeout}s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(overrides)} failed:\n{log[-4000:]}"
    return out


def train_losses(out: Path) -> list[float]:
    rows = csv.DictReader(open(out / "csv" / "version_0" / "metrics.csv"))
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return write_chat(d / "train.jsonl", n=64), write_chat(d / "heldout.jsonl", n=8, seed=5)


@pytest.fixture(scope="module")
def single(tmp_path_factory, files):
    out = run_job(tmp_path_factory.mktemp("single") / "run", files, "trainer.accumulate_grad_batches=2")
    losses = train_losses(out)
    assert len(losses) == STEPS and losses[-1] < 0.5 * losses[0], f"the reference run did not train: {losses}"
    acc = json.loads((out / "acceptance.json").read_text())
    assert acc["alpha"][0] > acc["alpha_untrained"][0] + 0.05, acc
    return out


@pytest.fixture(scope="module")
def heldout_loss(files):
    """KL of a saved head to the target on the held-out file, token-weighted over all of it."""
    from heads.target import load_target
    from train.data import DataConfig, DraftDataModule

    target = load_target("tiny-random")
    data = DraftDataModule(DataConfig(eval_files=[str(files[1])], respond="dataset", eval_batch_size=8), target,
                           mode="eval")
    data.prepare()

    @torch.no_grad()
    def measure(head_dir: Path) -> float:
        head, _ = load_head(head_dir)
        head.attach_target(target.embed_tokens, target.lm_head, target.final_norm)
        total, count = 0.0, 0
        for batch in data.eval_loader():
            feats = target.features(batch["input_ids"], batch["loss_mask"], batch["attention_mask"],
                                    layers=head.feature_layers)
            loss, _ = head_loss(head.eval(), head(feats), feats, "kl")
            n = int(batch["loss_mask"].sum())
            total, count = total + float(loss) * n, count + n
        return total / count
    return measure


def assert_same_run(run: Path, single: Path, heldout_loss) -> dict:
    mine, ref = load_head(run / "head")[0].state_dict(), load_head(single / "head")[0].state_dict()
    assert mine.keys() == ref.keys()
    for k in ref:
        assert mine[k].shape == ref[k].shape and mine[k].dtype == ref[k].dtype, k
        torch.testing.assert_close(mine[k], ref[k], rtol=0, atol=1e-4, msg=lambda m: f"{k}: {m}")
    loss, ref_loss = heldout_loss(run / "head"), heldout_loss(single / "head")
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    acc, ref_acc = (json.loads((d / "acceptance.json").read_text()) for d in (run, single))
    assert acc["num_tokens"] == ref_acc["num_tokens"]
    assert acc["alpha"] == pytest.approx(ref_acc["alpha"], abs=0.01)
    return {"heldout_kl": loss, "single_heldout_kl": ref_loss, "alpha": acc["alpha"]}


def test_ddp_two_processes_match_single(tmp_path, files, single, heldout_loss):
    run = run_job(tmp_path / "ddp", files, "trainer=ddp", *TWO_CPU_RANKS)
    assert_same_run(run, single, heldout_loss)
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_deepspeed_zero2_two_processes_match_single(tmp_path, files, single, heldout_loss):
    run = run_job(tmp_path / "zero2", files, "trainer=deepspeed_zero2", *TWO_CPU_RANKS)
    assert_same_run(run, single, heldout_loss)


def test_deepspeed_zero3_gathers_head_and_checkpoint_converts_to_fp32(tmp_path, files, single, heldout_loss):
    """ZeRO-3 shards every weight: DIR/head must still hold the whole fp32 head, and the sharded Lightning
    checkpoint must convert to one fp32 state dict holding the same weights."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    run = run_job(tmp_path / "zero3", files, "trainer=deepspeed_zero3", *TWO_CPU_RANKS)
    assert_same_run(run, single, heldout_loss)
    shards = run / "checkpoints" / "last.ckpt"
    assert shards.is_dir() and len(list(shards.glob("checkpoint/*optim_states.pt"))) == 2  # one shard per rank
    convert_zero_checkpoint_to_fp32_state_dict(str(shards), str(tmp_path / "fp32.ckpt"))
    converted = torch.load(tmp_path / "fp32.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    head = load_head(run / "head")[0].state_dict()
    params = {k.removeprefix("head."): v for k, v in converted.items() if k.startswith("head.")}
    assert set(params) == set(head)
    for k, v in params.items():
        assert v.dtype == (torch.float32 if v.is_floating_point() else head[k].dtype), k
        torch.testing.assert_close(v, head[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
