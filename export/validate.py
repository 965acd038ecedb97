"""Checks every export passes before it is moved into place; each is a plain function so tests can call it alone.

- ``check_keys``: the exact tensor set an engine builds from the *written* config (no missing, no unused key: vLLM's
  AutoWeightsLoader raises on unknown names, but SGLang and vLLM's Medusa skip them silently), shapes and dtypes.
- ``check_config``: the config fields the engine reads hold the values the head needs (missing flags are read
  with the engine's defaults, e.g. vLLM's speculators translation defaults norm_before_residual to true).
- ``check_vocab_map``: d2t/t2d describe one injective draft -> target map: nonzero(t2d) == d2t + arange.
- ``check_identity``: the target the export records is the head's target (hidden size, vocab, depth, tokenizer).
- ``check_forward``: the format's reference forward (export/reference.py, reading the files as the engine does)
  reproduces the head's training logits.
"""
from __future__ import annotations

import torch

from heads import build_head
from heads.base import TargetDims
from heads.checkpoint import check_target


def check_keys(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], float_dtype: torch.dtype | None = None):
    """expected: key -> (shape, dtype) with dtype None meaning "floating point" (then ``float_dtype`` if given)."""
    missing = sorted(set(expected) - set(tensors))
    unused = sorted(set(tensors) - set(expected))
    if missing or unused:
        raise ValueError(f"key set differs from what the engine builds: missing {missing}, unused {unused}")
    for key, (shape, dtype) in expected.items():
        t = tensors[key]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{key}: shape {tuple(t.shape)}, the engine builds {tuple(shape)}")
        if dtype is None:
            if not t.is_floating_point() or (float_dtype is not None and t.dtype != float_dtype):
                raise ValueError(f"{key}: dtype {t.dtype}, expected {float_dtype or 'floating point'}")
        elif t.dtype != dtype:
            raise ValueError(f"{key}: dtype {t.dtype}, expected {dtype}")


def get_path(config: dict, path: str):
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


def check_config(config: dict, required: dict) -> None:
    """required: dotted path -> value the field must hold (present, not defaulted)."""
    for path, want in required.items():
        try:
            have = get_path(config, path)
        except KeyError:
            raise ValueError(f"config.json lacks {path!r} (the engine would use its default; needs {want!r})") from None
        if have != want:
            raise ValueError(f"config.json {path!r} = {have!r}, needs {want!r}")


def check_vocab_map(d2t: torch.Tensor, vocab_size: int, t2d: torch.Tensor | None = None) -> torch.Tensor:
    """Returns draft -> target ids; raises unless they are distinct, in range, ascending, and t2d marks exactly them."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise ValueError(f"d2t must be a 1-D int64 tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    targets = d2t + torch.arange(d2t.numel())
    if targets.min() < 0 or targets.max() >= vocab_size:
        raise ValueError(f"d2t maps outside the target vocabulary [0, {vocab_size})")
    if not bool((targets[1:] > targets[:-1]).all()):
        raise ValueError("d2t + arange is not strictly ascending: the draft -> target map repeats or reorders ids")
    if t2d is not None:
        if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
            raise ValueError(f"t2d must be bool [{vocab_size}], got {t2d.dtype} {tuple(t2d.shape)}")
        if not torch.equal(t2d.nonzero().flatten(), targets):
            raise ValueError("nonzero(t2d) != d2t + arange: t2d and d2t describe different vocabularies")
    return targets


def check_identity(recorded: dict, head_config: dict, target_identity: dict) -> None:
    """The export's recorded target, the head's and the loaded target's must agree on what makes features match."""
    check_target(head_config, target_identity)
    check_target({"target": recorded}, target_identity)
    dims = head_config["dims"]
    for key, dim in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"), ("num_layers", "num_layers")):
        if target_identity.get(key) != dims[dim]:
            raise ValueError(f"target {key}={target_identity.get(key)} but the head was built for {dims[dim]}")


def head_logits(head_config: dict, state: dict, target, feats, num_steps: int, dtype: torch.dtype):
    """The training forward of a head rebuilt from the registry with its weights rounded to the export dtype, so the
    comparison measures the key map and the engine semantics, not bf16 rounding. Target-vocab logits [B, T-K, V]."""
    head = build_head(head_config["family"], TargetDims(**head_config["dims"]), **head_config["hparams"])
    head.load_state_dict({k: v.to(dtype).to(v.dtype) if v.is_floating_point() else v for k, v in state.items()})
    head.attach_target(target)
    head.eval()  # what drafting computes (EAGLE-1: the full lm_head, not its training loss vocabulary)
    T = feats.input_ids.shape[1]
    with torch.no_grad():
        out = head(feats, num_steps=num_steps)
    return [head.to_target_vocab(l.float())[:, : T - num_steps] for l in out.logits]


def check_forward(reference: list[torch.Tensor], trained: list[torch.Tensor], atol: float, rtol: float = 1e-4):
    """Per draft step: same unreachable (-inf) set, finite logits within tolerance. Returns max |diff| per step."""
    if len(reference) != len(trained):
        raise ValueError(f"reference drafted {len(reference)} steps, the head {len(trained)}")
    diffs = []
    for k, (ref, got) in enumerate(zip(reference, trained), start=1):
        if ref.shape != got.shape:
            raise ValueError(f"step {k}: reference logits {tuple(ref.shape)} vs head {tuple(got.shape)}")
        if not torch.equal(torch.isneginf(ref), torch.isneginf(got)):
            raise ValueError(f"step {k}: the reference reaches a different set of target tokens than the head")
        finite = torch.isfinite(got)
        diff = (ref[finite] - got[finite]).abs()
        bound = atol + rtol * got[finite].abs()
        if bool((diff > bound).any()):
            raise ValueError(f"step {k}: reference forward differs from the head's logits by {diff.max().item():.3g} "
                             f"(atol {atol}): the export's key map or config does not reproduce the head")
        diffs.append(diff.max().item() if diff.numel() else 0.0)
    return diffs
