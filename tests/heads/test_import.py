"""heads/layouts.py: a head exported to SafeAILab's EAGLE or FasterDecoding's Medusa layout (or saved natively)
imports back into a freshly built head with the same logits; a checkpoint that does not fit says what differs."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from export.main import export
from heads import build_head
from heads.checkpoint import save_head
from heads.layouts import read_state
from heads.target import Target, _tiny_random

CASES = [  # (family, format, hparams): the hard cases each layout can carry
    ("eagle", "eagle", {"loss_vocab_size": 64}),
    ("eagle3", "eagle", {"draft_vocab_size": 100, "aux_layers": [5, 2, 4]}),  # fc re-laid to (2, L//2, L-3) and back
    ("eagle3", "eagle", {"draft_vocab_size": 10**6}),  # the whole vocabulary: no d2t/t2d written
    ("eagle3", "vllm", {"draft_vocab_size": 100, "aux_layers": [6, 1, 3]}),  # aux ids from config.json, d2t alone
    ("medusa", "medusa", {"num_steps": 5}),
    ("medusa", "medusa", {"num_steps": 5, "bias": False}),  # written with zero biases, read back without
    ("eagle3", "native", {"draft_vocab_size": 100, "aux_layers": [6, 6, 1]}),
    ("mtp", "native", {"num_steps": 2}),
]


def fresh(target, family, **hp):
    """A head as train/ builds it before init_from: the run's hparams, initialised from the target."""
    head = build_head(family, target.dims, **hp)
    head.attach_target(target)
    if hasattr(head, "set_vocab_map"):
        head.set_vocab_map(torch.arange(target.dims.vocab_size, 0, -1))  # another vocabulary than the saved one's
    head.init_from_target()
    return head


def saved(target, family, tmp_path, fmt="native", **hp):
    """(DIR in ``fmt``, the head written there): random weights, so a dropped or misplaced tensor shows."""
    head = fresh(target, family, **hp)
    g = torch.Generator().manual_seed(1)
    if family == "eagle3":
        head.set_vocab_map(torch.rand(target.dims.vocab_size, generator=g))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    path = save_head(head, tmp_path / "run" / "head", target.identity())
    if fmt != "native":
        path = export({"head_path": str(path), "format": fmt, "out": str(tmp_path / fmt)})
    return path, head.eval()


def logits(head, target):
    ids = torch.randint(0, target.dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    feats = target.features(ids, layers=range(target.dims.num_layers + 1))
    with torch.no_grad():
        return [head.to_target_vocab(x) for x in head(feats).logits]


def imported(path, target, family, **hp):
    head = fresh(target, family, **hp)
    head.load_state_dict(read_state(path, head, target.identity()))
    return head.eval()


def variant(**overrides) -> Target:
    """tiny-random with other dimensions (same tokenizer): a target the head was not trained for."""
    return Target("tiny-random", *_tiny_random(**overrides))


@pytest.mark.parametrize("family,fmt,hp", CASES, ids=[f"{f}-{fmt}-{i}" for i, (f, fmt, _) in enumerate(CASES)])
def test_export_then_import_gives_identical_logits(family, fmt, hp, tiny_target, tmp_path):
    path, head = saved(tiny_target, family, tmp_path, fmt, **hp)
    back = imported(path, tiny_target, family, **{**hp, "num_steps": head.num_steps})
    for a, b in zip(logits(head, tiny_target), logits(back, tiny_target), strict=True):
        aux = hp.get("aux_layers")
        if fmt == "native" or aux is None or aux == sorted(aux):
            assert torch.equal(a, b)
        else:  # fc's column blocks came back permuted: the same sum in another order
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.shared
@pytest.mark.parametrize("family,fmt", [("eagle", "eagle"), ("medusa", "medusa")])
def test_round_trip_on_stories260k(family, fmt, stories_target, tmp_path):
    """A real target (its 5 layers repeat SafeAILab's EAGLE-3 taps, so EAGLE-3 cannot go to this layout there)."""
    hp = {"num_steps": 5} if family == "medusa" else {}
    path, head = saved(stories_target, family, tmp_path, fmt, **hp)
    back = imported(path, stories_target, family, **hp)
    for a, b in zip(logits(head, stories_target), logits(back, stories_target), strict=True):
        assert torch.equal(a, b)


@pytest.mark.shared
def test_a_head_for_another_target_family_is_refused(tiny_target, stories_target, tmp_path):
    """A head for tiny-random (byte-level BPE, 259 tokens) on stories260K (sentencepiece, 512): same width."""
    path, _ = saved(tiny_target, "medusa", tmp_path, "medusa", num_steps=5)
    (path / "draftheads_export.json").unlink()  # as published heads come: nothing but the layout's own files
    with pytest.raises(ValueError, match=r"vocabulary 259; this target has 512: use the target it was trained for"):
        read_state(path, fresh(stories_target, "medusa"), stories_target.identity())


def test_published_layout_variants(tiny_target, tmp_path):
    """What SafeAILab's own checkpoints hold beyond our export: pytorch_model.bin, the target's embedding, a zero
    fc bias. FasterDecoding's n-layer heads repeat one ResBlock under every layer index."""
    path, head = saved(tiny_target, "eagle", tmp_path, "eagle")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["embed_tokens.weight"] = tiny_target.embed_tokens.weight.detach().half()
    tensors["fc.bias"] = torch.zeros(tiny_target.dims.hidden_size)
    (path / "model.safetensors").unlink()
    torch.save(tensors, path / "pytorch_model.bin")
    assert torch.equal(logits(imported(path, tiny_target, "eagle"), tiny_target)[0], logits(head, tiny_target)[0])

    tensors["fc.bias"] += 0.1
    torch.save(tensors, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="fc has a bias .* retrain it with bias: false"):
        imported(path, tiny_target, "eagle")

    H, V, g = tiny_target.dims.hidden_size, tiny_target.dims.vocab_size, torch.Generator().manual_seed(3)
    medusa = tmp_path / "medusa2"
    medusa.mkdir()
    (medusa / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2}))
    block = {f"{h}": (torch.randn(H, H, generator=g) * 0.1, torch.randn(H, generator=g) * 0.1) for h in range(2)}
    file = {f"{h}.{layer}.linear.{name}": t for h, (w, b) in block.items() for layer in range(2)
            for name, t in (("weight", w), ("bias", b))}
    file.update({f"{h}.2.weight": torch.randn(V, H, generator=g) * 0.1 for h in range(2)})
    torch.save(file, medusa / "medusa_lm_head.pt")
    head = imported(medusa, tiny_target, "medusa", num_steps=2, num_layers=2)
    ids = torch.randint(0, V, (1, 8), generator=g)
    h = tiny_target.features(ids).hidden[tiny_target.dims.num_layers]  # the final-norm output Medusa reads
    for k in range(2):
        w, b = block[str(k)]
        x = h + torch.nn.functional.silu(h @ w.T + b)
        x = x + torch.nn.functional.silu(x @ w.T + b)  # the same ResBlock twice
        torch.testing.assert_close(head.head_logits(h, k), x @ file[f"{k}.2.weight"].T)


def test_a_checkpoint_that_does_not_fit_says_what_differs(tiny_target, tmp_path):
    path, _ = saved(tiny_target, "eagle3", tmp_path, "eagle", draft_vocab_size=100)
    cases = [  # (target, family, hparams) -> the one line that names the difference and the fix
        (variant(hidden_size=32, num_attention_heads=2, num_key_value_heads=1), "eagle3", {},
         r"\(hidden_size=64\), but this target 'tiny-random' has hidden_size=32; use the matching target"),
        (variant(vocab_size=300), "eagle3", {}, r"\(vocab_size=259\).* has vocab_size=300"),
        (variant(num_hidden_layers=10), "eagle3", {}, r"\(num_layers=8\).* has num_layers=10"),
        (tiny_target, "medusa", {}, r"holds eagle3 weights \(SafeAILab layout\) but this run trains head=medusa; "
                                    "pass head=eagle3"),
        (tiny_target, "eagle3", {"draft_vocab_size": 64},
         r"\{'draft_vocab_size': 100\}, this run's head has \{'draft_vocab_size': 64\}; pass "
         r"head.hparams.draft_vocab_size=100$"),
        (tiny_target, "eagle3", {"draft_vocab_size": 100, "fc_norm": True, "norm_output": True},  # SmolLM2's default
         r"\{'fc_norm': False, 'norm_output': False\}, this run's head has \{'fc_norm': True, 'norm_output': True\}; "
         r"pass head.hparams.fc_norm=false head.hparams.norm_output=false$"),
        (tiny_target, "eagle3", {"draft_vocab_size": 100, "aux_layers": [1, 3, 5]},
         r"fc reads target layers \[2, 4, 5\], this head reads \[1, 3, 5\]; pass head.hparams.aux_layers=\[2, 4, 5\]"),
    ]
    for target, family, hp, message in cases:
        head = fresh(target, family, **hp)
        with pytest.raises(ValueError, match=message) as caught:
            read_state(path, head, target.identity())
        assert "\n" not in str(caught.value)

    (path / "draftheads_export.json").unlink()  # a published head: the layout's files alone
    narrow = variant(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="with hidden size 64; this target has 32: use the target it was trained for"):
        read_state(path, fresh(narrow, "eagle3"), narrow.identity())
    shallow = variant(num_hidden_layers=6)  # SafeAILab's code would tap (2, 3, 3) there
    with pytest.raises(ValueError, match=r"tapping layers \(2, L//2, L-3\) = \[2, 3, 3\] of this 6-layer target"):
        read_state(path, fresh(shallow, "eagle3", draft_vocab_size=100), shallow.identity())


def test_medusa_hparams_and_foreign_directories(tiny_target, tmp_path):
    path, _ = saved(tiny_target, "medusa", tmp_path, "medusa", num_steps=5)
    with pytest.raises(ValueError, match=r"pass head.hparams.num_steps=5$"):
        read_state(path, fresh(tiny_target, "medusa", num_steps=3), tiny_target.identity())
    with pytest.raises(ValueError, match=r"pass head.hparams.bias=true"):
        read_state(path, fresh(tiny_target, "medusa", bias=False), tiny_target.identity())
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        read_state(tmp_path / "nowhere", fresh(tiny_target, "medusa"), tiny_target.identity())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    save_file({"x": torch.zeros(1)}, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="is not a draftheads head, a SafeAILab EAGLE or a FasterDecoding Medusa"):
        read_state(other, fresh(tiny_target, "medusa"), tiny_target.identity())
