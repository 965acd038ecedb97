"""keep_freed_memory: glibc keeps freed big blocks mapped, so allocating the same large buffer again does not fault
its pages in afresh; the training job turns it on unless keep_freed_memory=false."""
from __future__ import annotations

import subprocess
import sys

import pytest

# A training step in miniature: a 64 MiB buffer allocated, written and freed 20 times (over glibc's mmap threshold).
LOOP = """
import resource, sys
from train.trainer import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
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


def test_the_job_turns_it_on_unless_told_not_to(compose, tmp_path, monkeypatch):
    import train.main as job

    calls = []
    monkeypatch.setattr(job, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(job, "load_target", lambda *a, **k: (_ for _ in ()).throw(ValueError("stop here")))
    for value, expected in (("true", [1]), ("false", [])):
        calls.clear()
        with pytest.raises(job.UserError, match="stop here"):
            job.run(compose(tmp_path / value, f"keep_freed_memory={value}"))
        assert calls == expected
