"""Two-process DDP and DeepSpeed ZeRO-1/2/3 runs of ``python train/main.py`` on CPU (gloo) match a single process,
and a DDP or ZeRO-2 run killed with SIGKILL after a checkpoint ends, with ``resume=true``, where it would have.

"The same run" means the same global batch, seed and data order: the single process takes micro-batches of 4 and
accumulates 2 per step; two ranks take 4 each. The DataModule's sampler deals global batch i's micro-batches to
ranks (or accumulation slots) in the same order, and averaging two micro-batch gradients is what both accumulation
and DDP/ZeRO do, so the trained heads agree to float rounding. The loss is KL to the target (it falls to ~0; soft
CE sits on the random target's entropy) and the learning rate is high enough that 8 steps move the head a lot.

Each run is a subprocess in its own session, killed as a group on timeout: Lightning's DDP launcher re-runs the
command line for rank 1, which inside pytest would re-run pytest, and a hung rank must not outlive the test.

The held-out file has 16 records: their validation half (heads/splits.py) is 8 sequences, two eval batches of 4,
one per rank; fewer than one batch per rank leaves rank 1 an empty validation loader, which Lightning refuses.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
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
          "head.loss.kind=kl", "optim.name=adamw"]  # the one optimizer every strategy runs (auto: Muon off DeepSpeed)
TWO_CPU_RANKS = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def job_command(out: Path, files: tuple[Path, Path], *overrides: str) -> list[str]:
    train_file, eval_file = files
    return [sys.executable, "train/main.py", *COMMON, f"data.train_files=[{train_file}]",
            f"data.eval_files=[{eval_file}]", f"hydra.run.dir={out}", *overrides]


# One thread per process: two ranks already fill the cores, and spinning OpenMP threads slow a shared box 5x.
# PYTHONPATH: the killed runs' Hydra callback (StallAt below) is imported from this file.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}


def run_job(out: Path, files: tuple[Path, Path], *overrides: str, timeout: int = 300) -> Path:
    proc = subprocess.Popen(job_command(out, files, *overrides), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)  # rank 1 shares the pipe: this also waits for it
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session holds rank 0 and the rank 1 it launched
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(overrides)} timed out after {timeout}s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(overrides)} failed:\n{log[-4000:]}"
    return out


def train_losses(out: Path, version: int = 0) -> dict[int, float]:
    """step -> rank 0's logged training loss, from one CSV logger version (a resumed run writes the next one)."""
    rows = csv.DictReader(open(out / "csv" / f"version_{version}" / "metrics.csv"))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return write_chat(d / "train.jsonl", n=64), write_chat(d / "heldout.jsonl", n=16, seed=5)


@pytest.fixture(scope="module")
def single(tmp_path_factory, files):
    out = run_job(tmp_path_factory.mktemp("single") / "run", files, "trainer.accumulate_grad_batches=2")
    losses = list(train_losses(out).values())
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
        head.attach_target(target)
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


# The uninterrupted two-process runs: each matches the single process, and is what its kill-and-resume run must end as.
@pytest.fixture(scope="module")
def ddp(tmp_path_factory, files):
    return run_job(tmp_path_factory.mktemp("ddp") / "run", files, "trainer=ddp", *TWO_CPU_RANKS)


@pytest.fixture(scope="module")
def deepspeed_zero2(tmp_path_factory, files):
    return run_job(tmp_path_factory.mktemp("zero2") / "run", files, "trainer=deepspeed_zero2", *TWO_CPU_RANKS)


def test_ddp_two_processes_match_single(ddp, single, heldout_loss):
    assert_same_run(ddp, single, heldout_loss)
    assert (ddp / "checkpoints" / "last.ckpt").is_file()


def test_ddp_with_muon_matches_single(tmp_path, files, heldout_loss):
    """Muon (the default, optim.name=auto) orthogonalises the all-reduced gradient: two ranks step as one process."""
    single_muon = run_job(tmp_path / "single", files, "optim.name=muon", "trainer.accumulate_grad_batches=2")
    run = run_job(tmp_path / "ddp", files, "optim.name=muon", "trainer=ddp", *TWO_CPU_RANKS)
    assert_same_run(run, single_muon, heldout_loss)


def test_deepspeed_zero1_two_processes_match_single(tmp_path, files, single, heldout_loss):
    run = run_job(tmp_path / "zero1", files, "trainer=deepspeed_zero1", *TWO_CPU_RANKS)
    assert_same_run(run, single, heldout_loss)
    shards = run / "checkpoints" / "last.ckpt"  # ZeRO-1 partitions the optimizer states: one file per rank
    assert shards.is_dir() and len(list(shards.glob("checkpoint/*optim_states.pt"))) == 2


def test_deepspeed_zero2_two_processes_match_single(deepspeed_zero2, single, heldout_loss):
    assert_same_run(deepspeed_zero2, single, heldout_loss)


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


STALL_STEP = 6  # two steps past the step-4 checkpoint: work the kill throws away and the resumed run redoes


class StallAt:
    """A Hydra callback (``+hydra.callbacks.stall._target_=...``) that parks every rank before optimizer step
    STALL_STEP + 1 and says so in OUT/stalled-rank<R>, so the test's SIGKILL lands mid-run, after the step-4
    checkpoint and before the end, however slowly the box runs. Lightning re-runs the command line for rank 1, so
    both ranks load it. Nothing else about the run changes."""

    def on_job_start(self, config, **kwargs) -> None:
        from train.module import DraftModule

        def stall(module, batch, batch_idx):
            if module.global_step == STALL_STEP:
                Path(module.trainer.default_root_dir, f"stalled-rank{module.global_rank}").touch()
                time.sleep(3600)

        DraftModule.on_train_batch_start = stall  # the step timer it replaces only feeds trained tokens/s


def alive_in_group(pgid: int) -> list[int]:
    """Processes of this process group that are not zombies (Linux /proc)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def kill_mid_run(out: Path, files, *overrides: str, timeout: int = 300) -> None:
    """Start the run, wait until both ranks are parked at STALL_STEP, then SIGKILL the whole process group."""
    out.mkdir(parents=True)
    cmd = job_command(out, files, *overrides, "+hydra.callbacks.stall._target_=tests.train.test_distributed.StallAt")
    with open(out / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while not all((out / f"stalled-rank{r}").exists() for r in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the run to kill {'ended' if proc.returncode is not None else 'timed out'} before step "
                        f"{STALL_STEP}:\n{(out / 'killed.log').read_text()[-4000:]}")
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # rank 0 and the rank 1 it launched: the session is one process group
    assert proc.wait(timeout=30) == -signal.SIGKILL
    while alive_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive_in_group(proc.pid), "rank 1 outlived the SIGKILL"


@pytest.mark.parametrize("trainer", ["ddp", "deepspeed_zero2"])
def test_killed_run_resumes_to_the_uninterrupted_head(trainer, request, tmp_path, files, heldout_loss):
    """SIGKILL both ranks two steps after the step-4 checkpoint, then ``resume=true``: the run ends at the same
    step, with the same checks, token count, step losses and head as the uninterrupted run of the same seed.

    Both runs take the same batches on the same ranks and reduce the same two gradients in the same order, so a
    correct resume is equal up to float summation order: the measured gap is 0 (weights atol 1e-6 and held-out KL
    rel 1e-5, the single-process resume test's bound). A wrong resume misses by orders of magnitude more: the head
    kept at the step-4 check is asserted to sit > 100x that bound away from the final one, and so is the change of
    the logged loss over the last step alone.
    """
    reference = request.getfixturevalue(trainer)
    run = tmp_path / "run"
    kill_mid_run(run, files, f"trainer={trainer}", *TWO_CPU_RANKS)
    assert not (run / "acceptance.json").exists() and not (run / "head").exists()
    assert [c["step"] for c in json.loads((run / "checkpoints" / "heldout.json").read_text())["history"]] == [4]
    # the head kept at the step-4 check: where a resume that lost the optimizer's later steps would stand
    step4 = heldout_loss(next((run / "checkpoints").glob("best-step4.*")))

    run_job(run, files, f"trainer={trainer}", *TWO_CPU_RANKS, "resume=true")
    acc, ref_acc = (json.loads((d / "acceptance.json").read_text()) for d in (run, reference))
    assert acc["train_steps"] == ref_acc["train_steps"] == STEPS
    assert [c["step"] for c in acc["heldout_checks"]] == [c["step"] for c in ref_acc["heldout_checks"]] == [4, STEPS]
    assert acc["trained_tokens_total"] == ref_acc["trained_tokens_total"]  # steps 5-6 counted once, not twice
    assert acc["trained_tokens"] < ref_acc["trained_tokens"]  # and the resumed run trained only from step 4 on
    resumed, straight = train_losses(run, version=1), train_losses(reference)
    assert sorted(resumed) == sorted(straight)[4:], (resumed, straight)  # it logged steps 5-8, from step 4
    for step, loss in resumed.items():  # the same batches in the same order: the same loss at every step
        assert loss == pytest.approx(straight[step], rel=1e-5), (step, resumed, straight)

    mine, ref = (load_head(d / "head")[0].state_dict() for d in (run, reference))
    assert mine.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    loss, ref_loss = heldout_loss(run / "head"), heldout_loss(reference / "head")
    print(f"{trainer}: held-out KL resumed {loss:.9g}, uninterrupted {ref_loss:.9g}, step-4 head {step4:.6g}; "
          f"max |Δw| {max(float((mine[k] - ref[k]).abs().max()) for k in ref if ref[k].is_floating_point()):.3g}")
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    # the bounds can fail: the step-4 head, and the last step's loss change, lie far outside them
    assert abs(step4 - ref_loss) > 100 * 1e-5 * ref_loss, (step4, ref_loss)
    before_last, last = (straight[s] for s in sorted(straight)[-2:])
    assert abs(last - before_last) > 100 * 1e-5 * last, straight
