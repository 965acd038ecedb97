"""Shared fixtures: a seeded tiny random Llama target, and the ../shared gate."""
from __future__ import annotations

import os

import pytest
import torch

from heads.target import load_target, shared_dir


@pytest.fixture(scope="session")
def tiny_target():
    return load_target("tiny-random")


def require_shared(*parts: str):
    """Path under ../shared, or skip (fail when REQUIRE_SHARED=1, as CI sets it)."""
    path = shared_dir().joinpath(*parts)
    if not path.exists():
        if os.environ.get("REQUIRE_SHARED") == "1":
            pytest.fail(f"REQUIRE_SHARED=1 but {path} is missing")
        pytest.skip(f"needs {path} (../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def stories_target():
    require_shared("models", "stories260K-hf")
    return load_target("stories260k")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
