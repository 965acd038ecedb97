"""The big targets' recipes (conf/experiment/) and per-target defaults (conf/target_defaults/) compose, pick the
anchors' numbers, and say what they need and where the numbers come from.

Each file's own numbers are read from the file and looked up in the composed config, so the check is that they
reach the job: a defaults list that applied the recipe before a target's defaults (or a group that overrode it)
would hand training another learning rate or step count. Every recipe sets something its target's defaults set
differently, so a wrong order shows (test_recipe_wins_over_its_target_defaults says which keys).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[2] / "conf"
RECIPES = {  # experiment -> (the anchor's target hub id, head family, data): the published setting each reproduces
    "llama2-7b-eagle": ("meta-llama/Llama-2-7b-chat-hf", "eagle", "sharegpt"),
    "vicuna-7b-eagle": ("lmsys/vicuna-7b-v1.3", "eagle", "sharegpt"),
    "vicuna-7b-medusa": ("lmsys/vicuna-7b-v1.3", "medusa", "sharegpt"),
    "llama3.1-8b-eagle3": ("meta-llama/Llama-3.1-8B-Instruct", "eagle3", "ultrachat"),
    "llama3.1-8b-medusa": ("meta-llama/Llama-3.1-8B-Instruct", "medusa", "ultrachat"),
}
TARGETS = ["llama2-7b", "vicuna-7b", "llama3.1-8b-instruct"]


def composed(*overrides, conf: Path = CONF):
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return compose("config", overrides=list(overrides))


def settings(path: Path) -> dict[str, object]:
    """A config file's own values, {"a.b.c": value}, without its defaults list."""
    raw = OmegaConf.to_container(OmegaConf.load(path))
    raw.pop("defaults", None)
    out = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value
    walk(raw, "")
    return out


def groups(path: Path) -> dict[str, str]:
    """A recipe's `override /group: choice` entries."""
    return {k.removeprefix("override /"): v for entry in OmegaConf.load(path).get("defaults", [])
            for k, v in entry.items()}


def assert_reaches_the_job(cfg, path: Path) -> None:
    own = settings(path)
    assert own, path
    got = {key: OmegaConf.select(cfg, key) for key in own}
    assert got == own, {k: (got[k], own[k]) for k in own if got[k] != own[k]}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe(name, conf=CONF):
    hub, head, data = RECIPES[name]
    cfg = composed(f"experiment={name}", conf=conf)
    assert (cfg.target.name, cfg.head.name, cfg.data.name) == (hub, head, data)
    assert_reaches_the_job(cfg, conf / "experiment" / f"{name}.yaml")
    chosen = groups(conf / "experiment" / f"{name}.yaml")
    assert chosen["target"] in TARGETS and chosen["trainer"].startswith("deepspeed_zero")
    assert cfg.trainer.strategy == "deepspeed_zero"  # the trainer group the recipe names, multi-GPU
    text = (conf / "experiment" / f"{name}.yaml").read_text()
    assert "# Needs:" in text and "# Numbers from:" in text and "GPU" in text


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_wins_over_its_target_defaults(name, conf=CONF):
    """The recipe and its target's defaults disagree somewhere (so test_recipe can see a wrong order)."""
    recipe = settings(conf / "experiment" / f"{name}.yaml")
    defaults = settings(conf / "target_defaults" / f"{groups(conf / 'experiment' / f'{name}.yaml')['target']}.yaml")
    assert [k for k in recipe if k in defaults and recipe[k] != defaults[k]], name


@pytest.mark.parametrize("target", TARGETS)
def test_big_target_defaults_replace_the_cpu_toys(target, conf=CONF):
    toy = composed("head=eagle3", conf=conf)
    cfg = composed("head=eagle3", f"target={target}", conf=conf)
    assert_reaches_the_job(cfg, conf / "target_defaults" / f"{target}.yaml")
    replaced = [k for k, v in settings(conf / "target_defaults" / f"{target}.yaml").items()
                if OmegaConf.select(toy, k) != v]
    assert {"trainer.max_steps", "optim.lr"} <= set(replaced), replaced  # the toy's numbers were not the big ones
    # EAGLE-3's K and draft vocabulary come from the target's defaults through the head's interpolation
    assert (cfg.head.hparams.num_steps, cfg.head.hparams.draft_vocab_size) == (
        cfg.target.eagle3_steps, cfg.target.eagle3_draft_vocab)
    assert (toy.head.hparams.num_steps, toy.head.hparams.draft_vocab_size) != (
        cfg.head.hparams.num_steps, cfg.head.hparams.draft_vocab_size) and cfg.target.chat_format != "chatml"
    assert composed("head=eagle3", f"target={target}", "trainer.max_steps=5", conf=conf).trainer.max_steps == 5
    assert composed("head=eagle", f"target={target}", "trainer=ddp", conf=conf).trainer.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("trainer", ["auto", "cpu"])
def test_the_embedded_default_steps_are_the_heads(trainer):
    # EAGLE-3 asks for 360 steps (head.default_job_steps, levers.md study 4); a head without the key keeps 180
    steps = {h: composed(f"head={h}", f"trainer={trainer}").trainer.max_steps for h in ("eagle3", "medusa", "eagle")}
    assert steps == {"eagle3": composed("head=eagle3").head.default_job_steps, "medusa": 180, "eagle": 180}
    assert steps["eagle3"] > steps["medusa"]
    assert composed("head=eagle3", f"trainer={trainer}", "trainer.max_steps=7").trainer.max_steps == 7
