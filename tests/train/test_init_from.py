"""init_from=DIR: run(cfg) starts from an exported head's weights (heads/layouts.py), or refuses in one line."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from export.main import export
from heads import build_head
from heads.checkpoint import save_head
from train import UserError
from train.main import run


def exported_eagle3(target, tmp_path):
    """A random EAGLE-3 head in SafeAILab's layout, and its native tensors."""
    head = build_head("eagle3", target.dims, num_steps=2, draft_vocab_size=100)
    head.attach_target(target)
    g = torch.Generator().manual_seed(4)
    head.set_vocab_map(torch.rand(target.dims.vocab_size, generator=g))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    native = save_head(head, tmp_path / "published" / "head", target.identity())
    out = export({"head_path": str(native), "format": "eagle", "out": str(tmp_path / "eagle")})
    return out, head.state_dict()


def test_training_starts_from_the_imported_head(fast_cfg, tiny_target, tmp_path):
    """With lr 0 the head training writes is the imported one, tensor for tensor (d2t/t2d included: the data's own
    draft vocabulary is another one)."""
    published, state = exported_eagle3(tiny_target, tmp_path)
    out = tmp_path / "run"
    run(fast_cfg("head=eagle3", "head.hparams.num_steps=2", "head.hparams.draft_vocab_size=100", "optim.lr=0",
                 "trainer.max_steps=2", f"init_from={published}", out=out))
    written = load_file(str(out / "head" / "model.safetensors"))
    assert written.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(written[k], v), k


def test_a_head_that_does_not_fit_is_one_line(fast_cfg, tiny_target, tmp_path):
    published, _ = exported_eagle3(tiny_target, tmp_path)
    with pytest.raises(UserError, match=r"^init_from=.*pass head.hparams.draft_vocab_size=100$") as caught:
        run(fast_cfg("head=eagle3", "head.hparams.draft_vocab_size=64", "trainer.max_steps=1",
                     f"init_from={published}"))
    assert "\n" not in str(caught.value)
