"""A bf16 target training an fp32 head: features are cast at the boundary (TargetFeatures.hidden_as) and the frozen
lm_head runs in its own dtype (DraftHead.target_lm_head), in training, validation α and the final α. The big
targets' stand-ins (tests/test_headline.py) take the same path through export and serve/ as well."""
from __future__ import annotations

import pytest
import torch

from heads import HEADS
from train.main import run


@pytest.mark.parametrize("name", sorted(HEADS))
def test_bf16_target_trains_fp32_head(name, fast_cfg, tmp_path):
    cfg = fast_cfg(f"head={name}", "target.dtype=bfloat16", "trainer.max_steps=4", "trainer.limit_val_batches=1",
                   "trainer.val_check_interval=2", out=tmp_path / name)
    record = run(cfg)
    assert len(record["alpha"]) == cfg.head.hparams.num_steps and record["num_tokens"] > 100
    # greedy α counts matches over the scored anchors: whole numbers of them (a path that measured soft overlaps in
    # bf16, or divided by another count, would not give them)
    assert record["temperature"] == 0.0
    hits = [a * n for a, n in zip(record["alpha"] + record["alpha_untrained"], record["num_tokens_per_step"] * 2)]
    assert all(abs(h - round(h)) < 1e-6 for h in hits), hits
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / name / "head" / "model.safetensors"))
    assert all(w.dtype == torch.float32 for w in weights.values() if w.is_floating_point())  # the head stays fp32


@pytest.mark.slow
def test_bf16_smollm2_trains_fp32_head(chat_files, tmp_path):
    """SmolLM2 with target.dtype=bfloat16, as its config suggests, on answered chat data (no self-distillation)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    train_file, eval_file = chat_files
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base=None):
        cfg = compose("config", [f"out_dir={tmp_path}", "target=smollm2-135m", "target.dtype=bfloat16", "head=eagle3",
                                 "logger=none", f"data.train_files=[{train_file}]", f"data.eval_files=[{eval_file}]",
                                 "data.max_len=64", "data.batch_size=2", "data.eval_batch_size=4",
                                 "data.max_train_records=8", "data.max_eval_records=2", "trainer.max_steps=2",
                                 "trainer.enable_progress_bar=false", "head.hparams.draft_vocab_size=1024"])
    record = run(cfg)
    assert len(record["alpha"]) == 3 and record["num_tokens"] > 0
