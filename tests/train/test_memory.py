"""keep_freed_memory: glibc keeps freed big blocks mapped, so allocating the same large buffer again does not fault
its pages in afresh; the trim callback gives them back; the training job turns both on unless
keep_freed_memory=false."""
from __future__ import annotations

import subprocess
import sys

import pytest

# A training step in miniature: a 64 MiB buffer allocated, written and freed 20 times (over glibc's mmap threshold).
LOOP = """
import resource, sys
from train.trainer import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] != "default" else None
if sys.argv[1] == "restored":  # what the callback does at the end of fit
    kept = keep_freed_memory(keep=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    buf = bytearray(64 << 20)
    buf[::4096] = b"x" * len(buf[::4096])
    del buf
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(arm: str) -> tuple[str, int]:
    proc = subprocess.run([sys.executable, "-c", LOOP, arm], capture_output=True, text=True, timeout=120, check=True)
    kept, count = proc.stdout.split()
    return kept, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_kept_memory_is_not_faulted_in_again():
    (_, default), (kept, keep) = faults("default"), faults("keep")
    assert kept == "True"
    # glibc's defaults: every round maps 16,384 fresh pages; kept: only the first round does
    assert default > 20 * 16_000 and keep < default / 5
    restored, again = faults("restored")
    assert restored == "True" and again > default / 2  # glibc's thresholds are back after fit


TRIM = """
from train.trainer import keep_freed_memory, trim_freed_memory
rss = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) // 1024
keep_freed_memory()
callback = trim_freed_memory(every=2)  # first: importing Lightning would reuse the freed block below
buf = bytearray(256 << 20)
buf[::4096] = b"x" * len(buf[::4096])
small = bytearray(16)  # above the freed block: the heap's top cannot simply shrink
del buf
kept = rss()
callback.on_train_batch_end(type("T", (), {"global_step": 1})())
untrimmed = rss()
callback.on_train_batch_end(type("T", (), {"global_step": 2})())
print(kept, untrimmed, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_the_trim_callback_gives_kept_memory_back_every_n_steps():
    proc = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, timeout=120, check=True)
    kept, untrimmed, trimmed = map(int, proc.stdout.split())  # MiB of anonymous memory
    assert kept > 250 and untrimmed > 250  # kept after free, and still kept at a step that is not the n-th
    assert trimmed < kept - 200


def test_the_job_turns_it_on_unless_told_not_to(compose, tmp_path):
    from train.trainer import build_trainer, resolve_hardware

    for value, expected in (("true", ["TrimFreedMemory"]), ("false", [])):
        cfg = compose(tmp_path / f"t-{value}", f"keep_freed_memory={value}")
        resolve_hardware(cfg)
        trainer = build_trainer(cfg, tmp_path)
        assert [type(c).__name__ for c in trainer.callbacks if "Trim" in type(c).__name__] == expected
