"""Fixtures for train/: a composed Hydra config shrunk to CPU, few steps, no logger, output in tmp_path."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import train.main  # noqa: F401  registers the ${shared:} resolver

CONF = Path(__file__).resolve().parents[2] / "conf"
FAST = ["target=tiny-random", "logger=none", "trainer.max_steps=8", "trainer.enable_progress_bar=false",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
        "trainer.checkpoint_every_n_steps=4", "data.batch_size=4", "data.eval_batch_size=8", "optim.warmup_steps=2"]

TOPICS = ["the sea", "a red kite", "bread", "winter", "a small robot", "the moon", "trains", "a garden", "music",
          "a library", "rain", "mountains", "a lost key", "coffee", "bicycles", "stars"]


def compose_cfg(out_dir, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=[f"out_dir={out_dir}", *FAST, *overrides])


def write_chat(path: Path, n: int = 32, seed: int = 0) -> Path:
    """Answered chat records (our own text): fast tiny-random training without self-distillation."""
    with open(path, "w") as f:
        for i in range(n):
            topic = TOPICS[(i + seed) % len(TOPICS)]
            answer = f"Here is a note about {topic}. " * (1 + i % 3) + f"That is all about {topic} for now."
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {topic} ({i})."},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.fixture(name="compose")
def compose_fixture():
    """compose_cfg as a fixture: test modules never import conftest by name (several test folders have one)."""
    return compose_cfg


@pytest.fixture(name="write_chat")
def write_chat_fixture():
    return write_chat


@pytest.fixture
def chat_files(tmp_path):
    return write_chat(tmp_path / "train.jsonl"), write_chat(tmp_path / "heldout.jsonl", n=8, seed=5)


@pytest.fixture
def fast_cfg(tmp_path, chat_files):
    """A config that trains a head on tiny-random for a few steps over answered chat data."""
    def make(*overrides: str, out: Path | None = None):
        train_file, eval_file = chat_files
        return compose_cfg(out or tmp_path / "run", f"data.train_files=[{train_file}]",
                           f"data.eval_files=[{eval_file}]", *overrides)
    return make
