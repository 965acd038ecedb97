"""Draft heads: one family per file, one registry. See heads/base.py for the contract."""
from __future__ import annotations

from heads.base import DraftHead, HeadOutput, TargetDims, TargetFeatures
from heads.eagle import Eagle
from heads.eagle3 import Eagle3
from heads.medusa import Medusa
from heads.mtp import Mtp

HEADS: dict[str, type[DraftHead]] = {"medusa": Medusa, "eagle": Eagle, "eagle3": Eagle3, "mtp": Mtp}


def build_head(name: str, dims: TargetDims, **hparams) -> DraftHead:
    if name not in HEADS:
        raise ValueError(f"unknown head {name!r}; choose one of {sorted(HEADS)}")
    return HEADS[name](dims, **hparams)


__all__ = ["HEADS", "build_head", "DraftHead", "HeadOutput", "TargetDims", "TargetFeatures"]
