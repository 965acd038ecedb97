"""What the runner and its benchmarks load before decoding: the device and dtype, and a draft head made ready to
draft against serve/model.py's target (its checkpoint checked against the target it was trained on)."""
from __future__ import annotations

from pathlib import Path

import torch

from heads.checkpoint import check_target, load_head
from heads.errors import UserError
from heads.target import resolve_dtype
from serve.linear import fast_linears


def resolve_device(cfg) -> tuple[str, torch.dtype]:
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    name = cfg.dtype if cfg.dtype != "auto" else resolve_dtype(cfg.target.dtype if device == "cpu" else "auto", device)
    return device, getattr(torch, name)


def load_draft_head(head_path, target, model, dtype):
    """-> (the head ready to draft, the directory it came from: DIR or a training run's DIR/head)."""
    path = Path(head_path)
    if not (path / "config.json").exists() and (path / "head" / "config.json").exists():
        path = path / "head"  # a training run's output directory
    try:
        head, config = load_head(path, device=str(model.device))
        check_target(config, target.identity())
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    return ready_to_draft(head, model, dtype), path


def ready_to_draft(head, model, dtype):
    """Attach the runner's target modules and give the head the runner's projections (serve.linear.fast_linears; on
    the project's 2-core CPU an EAGLE-3 draft step went from 5.4 to 4.5 ms, its own 32k-row lm_head's share)."""
    head.attach_modules(model.embed_tokens, model.lm_head, model.norm)
    return fast_linears(head.to(dtype).eval().requires_grad_(False))
