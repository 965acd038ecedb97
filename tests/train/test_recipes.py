"""The big targets' recipes (conf/experiment/) and per-target defaults (conf/target_defaults/) compose, pick the
anchors' numbers, and say what they need and where the numbers come from."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

CONF = Path(__file__).resolve().parents[2] / "conf"
RECIPES = {  # experiment -> (target hub id, head, data, lr, K)
    "llama2-7b-eagle": ("meta-llama/Llama-2-7b-chat-hf", "eagle", "sharegpt", 3e-5, 4),
    "vicuna-7b-eagle": ("lmsys/vicuna-7b-v1.3", "eagle", "sharegpt", 3e-5, 4),
    "vicuna-7b-medusa": ("lmsys/vicuna-7b-v1.3", "medusa", "sharegpt", 1e-3, 5),
    "llama3.1-8b-eagle3": ("meta-llama/Llama-3.1-8B-Instruct", "eagle3", "ultrachat", 5e-5, 7),
    "llama3.1-8b-medusa": ("meta-llama/Llama-3.1-8B-Instruct", "medusa", "ultrachat", 1e-3, 5),
}


def composed(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe(name):
    hub, head, data, lr, K = RECIPES[name]
    cfg = composed(f"experiment={name}")
    assert (cfg.target.name, cfg.head.name, cfg.data.name) == (hub, head, data)
    assert cfg.optim.lr == lr and cfg.head.hparams.num_steps == K and cfg.data.respond == "target"
    assert cfg.trainer.strategy == "deepspeed_zero" and cfg.trainer.max_steps >= 1000 and cfg.data.max_len == 2048
    if head == "eagle3":
        assert cfg.head.hparams.draft_vocab_size == 32000
    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    assert "# Needs:" in text and "# Numbers from:" in text and "GPU" in text


@pytest.mark.parametrize("target", ["llama2-7b", "vicuna-7b", "llama3.1-8b-instruct"])
def test_big_target_defaults_replace_the_cpu_toys(target):
    toy = composed("head=eagle3")
    cfg = composed("head=eagle3", f"target={target}")
    assert (toy.trainer.max_steps, toy.optim.lr, toy.head.hparams.draft_vocab_size) == (180, 2e-3, 8192)
    assert (cfg.trainer.max_steps, cfg.optim.lr, cfg.head.hparams.draft_vocab_size) == (1000, 1e-4, 32000)
    assert cfg.head.hparams.num_steps == 7 and cfg.target.chat_format != "chatml"
    assert composed("head=eagle3", f"target={target}", "trainer.max_steps=5").trainer.max_steps == 5  # CLI wins
    assert composed("head=eagle", f"target={target}", "trainer=ddp").trainer.max_steps == 1000
