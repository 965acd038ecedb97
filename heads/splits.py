"""Held-out prompts split once into validation and test, the same way in train/ and serve/.

Validation is what a run may tune on: mid-run α checks, the choice of the kept head, and the α that gamma=auto and
the benchmarks' predictions read from acceptance.json. Test is what nothing tunes on: the benchmarks decode it and
the docs' tables report it. The split is deterministic and needs no seed: within each category (Spec-Bench's
``category`` field; records without one form one group), in file order, even ranks are validation and odd ranks
test, so every category is halved evenly (Spec-Bench's 480 questions: 240 and 240, 13 categories each side).
Both halves must be assigned on the whole file, before any subsetting, so train/ and serve/ agree.

A prompt is recognised by ``prompt_key``, a hash of its first user turn, whatever answer follows it.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable

SPLITS = ("validation", "test")


def prompt_key(first_turn: str) -> str:
    """The hash train/ records and serve/ checks: the held-out records' keys (heads.records.Record.key)."""
    return hashlib.sha1(json.dumps([first_turn]).encode()).hexdigest()


def assign_splits(categories: Iterable[str | None]) -> list[str]:
    """"validation" or "test" for each record, given each record's category in file order."""
    rank: Counter = Counter()
    out = []
    for category in categories:
        out.append(SPLITS[rank[category] % 2])
        rank[category] += 1
    return out


def check_split(split: str | None) -> None:
    if split not in (None, *SPLITS):
        raise ValueError(f"split={split!r}; choose validation, test or null (every prompt)")
