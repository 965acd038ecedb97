"""Export fixtures: native head directories with non-trivial weights, and a one-call export helper."""
from __future__ import annotations

import pytest
import torch

from export.main import export
from heads import build_head
from heads.checkpoint import save_head

def random_head(target, family: str, num_steps: int = 3, seed: int = 0, **hp):
    """A head with random weights (std 0.1): zero-initialised parts (Medusa's blocks) would hide key-map bugs."""
    head = build_head(family, target.dims, num_steps=num_steps, **hp)
    head.attach_target(target)
    g = torch.Generator().manual_seed(seed)
    if family == "eagle3":
        head.set_vocab_map(torch.rand(target.dims.vocab_size, generator=g))
    head.init_from_target()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return head


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: one thread is ~10x faster than several fighting over a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pair_hparams():
    return hparams_for


def hparams_for(family: str, fmt: str, target) -> dict:
    """Hyper-parameters that exercise each format's hard cases where the format can carry them."""
    loss_vocab = {"loss_vocab_size": target.dims.vocab_size // 4, "loss_vocab_sampled": 8}  # training-only
    if family == "medusa":  # every export must draft over the full lm_heads
        return {"num_steps": 5, **loss_vocab} if fmt == "medusa" else loss_vocab  # FasterDecoding's loader builds 5
    if family == "eagle3":
        hp = {"draft_vocab_size": target.dims.vocab_size // 2}
        if fmt != "eagle":  # SafeAILab's code reads only (2, L//2, L-3)
            L = target.dims.num_layers
            hp["aux_layers"] = [L - 3, 2, L - 3]  # unsorted with a repeat: exports must fold and re-lay fc
        return hp
    if family in ("eagle", "mtp"):
        return loss_vocab
    return {}


@pytest.fixture
def head_dir(tmp_path):
    """head_dir(target, family, **hp) -> (DIR/head, head): a saved native head, like train/ writes it."""
    def make(target, family, name="run", **hp):
        head = random_head(target, family, **hp)
        path = save_head(head, tmp_path / name / "head", target.identity())
        return path, head

    return make


@pytest.fixture
def run_export():
    """run_export(head_path, fmt, out, **conf_overrides) -> out: export/main.py's export() as the CLI calls it."""
    def run(head_path, fmt, out, **overrides):
        return export({"head_path": str(head_path), "format": fmt, "out": str(out), **overrides})

    return run
