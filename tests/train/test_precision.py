"""trainer.precision=bf16-if-faster: which CPUs time the two precisions, that the faster one is trained in, and that
timing them moves no weight and draws nothing training would see. Step times are set by the test (a real step runs,
its seconds are replaced), so nothing here depends on this machine's speed."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import train.precision
import train.trainer
from train.main import run


@pytest.mark.parametrize("has_units, devices, expected", [
    (False, 1, "32-true"),                # emulated bf16: nothing to time
    (True, 1, "bf16-if-faster"),          # left for fit to time
    (True, "auto", "bf16-if-faster"),
    (True, 2, "bf16-mixed"),              # several processes would each time and might disagree: bf16-if-native
])
def test_which_cpus_time_the_two_precisions(monkeypatch, has_units, devices, expected):
    monkeypatch.setattr(train.trainer, "cpu_has_bf16_units", lambda: has_units)
    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": devices, "precision": "bf16-if-faster",
                                        "strategy": "auto"}, "target": {"dtype": "float32"}})
    train.trainer.resolve_hardware(cfg)
    assert cfg.trainer.precision == expected


@pytest.fixture
def bf16_step_takes(monkeypatch):
    """Give the CPU bf16 units, and make a bf16 step take ``ratio`` times an fp32 step (1 s)."""
    monkeypatch.setattr(train.trainer, "cpu_has_bf16_units", lambda: True)
    real_step = train.precision.time_step

    def set_ratio(ratio: float):
        def timed(module, batch, dtype):
            real_step(module, batch, dtype)  # the real forward and backward, under the real autocast
            return ratio if dtype is torch.bfloat16 else 1.0

        monkeypatch.setattr(train.precision, "time_step", timed)
    return set_ratio


@pytest.mark.parametrize("ratio, chosen", [(0.5, "bf16-mixed"), (0.97, "32-true"), (1.5, "32-true")])
def test_the_faster_precision_trains(fast_cfg, tmp_path, bf16_step_takes, ratio, chosen):
    bf16_step_takes(ratio)
    record = run(fast_cfg("head=eagle3", "trainer.precision=bf16-if-faster", "trainer.max_steps=4",
                          out=tmp_path / "run"))
    probe = record["precision"]["probe"]
    assert probe["precision"] == chosen and record["precision"]["trainer"] == chosen, record["precision"]
    assert probe["seconds_per_step"] == {"32-true": 1.0, "bf16-mixed": ratio}
    # Muon orthogonalises in the dtype training computes in (train/optimizers.py)
    assert record["precision"]["muon_newton_schulz"] == ("bfloat16" if chosen == "bf16-mixed" else "float32")


def test_timing_moves_no_weight(fast_cfg, tmp_path, bf16_step_takes):
    """A run whose probe chose fp32 trains the very head an fp32 run trains: same weights, same α."""
    bf16_step_takes(2.0)
    args = ("head=medusa", "trainer.max_steps=6")  # Medusa: its loss vocabulary is drawn every step
    probed = run(fast_cfg(*args, "trainer.precision=bf16-if-faster", out=tmp_path / "probed"))
    plain = run(fast_cfg(*args, "trainer.precision=32-true", out=tmp_path / "plain"))
    assert probed["precision"]["probe"]["precision"] == "32-true" and "probe" not in plain["precision"]
    a, b = (load_file(str(tmp_path / d / "head" / "model.safetensors")) for d in ("probed", "plain"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert probed["alpha"] == plain["alpha"]
