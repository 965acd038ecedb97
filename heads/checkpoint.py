"""The native head format: a directory with ``config.json`` and ``model.safetensors``.

config.json holds what rebuilds the head without Hydra or Lightning: the family (the registry key), its
hyper-parameters, the target's dimensions and identity (checked when a head meets a target), the hidden-state
layers it reads, and, once serve/ has measured them, recommended drafting settings. Writes are atomic: a crash
leaves the previous head or none, never half of one.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import load_file, save_file

from heads.base import DraftHead, TargetDims

FORMAT_VERSION = 1


def save_head(head: DraftHead, path: str | os.PathLike, target_identity: dict, extra: dict | None = None) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {
        "format_version": FORMAT_VERSION, "family": head.family, "hparams": head.hparams(),
        "dims": asdict(head.dims), "target": target_identity, "feature_layers": list(head.feature_layers),
        **(extra or {}),
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"family": head.family})
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def read_config(path: str | os.PathLike) -> dict:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not a draftheads head: no config.json (expected DIR/head from train/)")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); re-export the head") from e
    if "family" not in config or "dims" not in config:
        raise ValueError(f"{cfg_file} lacks 'family'/'dims': not a draftheads head config")
    return config


def load_head(path: str | os.PathLike, device: str = "cpu") -> tuple[DraftHead, dict]:
    """Rebuild a head from its directory; returns (head, config). Weights load with safetensors (no pickle)."""
    from heads import build_head

    config = read_config(path)
    head = build_head(config["family"], TargetDims(**config["dims"]), **config["hparams"])
    weights = Path(path) / "model.safetensors"
    try:
        state = load_file(str(weights), device=device)
    except Exception as e:  # safetensors raises several types for truncated or foreign files
        raise ValueError(f"cannot read {weights}: {e}; the file is missing or corrupt") from e
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights} does not match a {config['family']} head: missing {missing}, unused {unexpected}")
    return head.to(device).eval(), config  # eval: inference reads (EAGLE-1's training-only loss vocabulary is off)


def check_target(config: dict, target_identity: dict) -> None:
    """Refuse a head trained for another target (hidden size, vocabulary, depth or tokenizer differ)."""
    mine = config.get("target", {})
    for key in ("hidden_size", "vocab_size", "num_layers", "tokenizer_sha256"):
        if key in mine and mine[key] != target_identity.get(key):
            raise ValueError(
                f"head was trained for target {mine.get('name')!r} ({key}={mine[key]}), but this target "
                f"{target_identity.get('name')!r} has {key}={target_identity.get(key)}; use the matching target"
            )


