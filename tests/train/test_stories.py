"""stories260K: every head family, trained briefly on the target's own stories, drafts held-out TinyStories text
clearly better than it did untrained (α_1 on ../shared's validation text, which training never sees)."""
from __future__ import annotations

import pytest

from heads import HEADS
from train.main import run

pytestmark = [pytest.mark.shared, pytest.mark.slow]


@pytest.fixture(scope="module")
def stories_cache(tmp_path_factory):
    """One self-distilled story set for all families (the data cache is keyed by target + prompts + settings)."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("name", sorted(HEADS))
def test_stories260k_head_beats_untrained(name, stories_target, stories_cache, compose, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(stories_cache))
    # Brief on purpose (~15-40 s of CPU per family): two draft steps, 150 steps of 16 stories cut to 128 tokens.
    cfg = compose(tmp_path, "target=stories260k", "data=tinystories", f"head={name}", "head.hparams.num_steps=2",
                  "trainer.max_steps=150", "trainer.val_check_interval=1000", "trainer.checkpoint_every_n_steps=1000",
                  "optim.lr=3e-3", "optim.warmup_steps=10", "data.batch_size=16", "data.eval_batch_size=32",
                  "data.max_len=128", "data.max_eval_records=100", "data.distill.samples_per_prompt=6")
    record = run(cfg)
    trained, untrained = record["alpha"][0], record["alpha_untrained"][0]
    assert record["num_tokens"] > 5000  # real held-out text, not a handful of tokens
    assert trained > untrained + 0.1 and trained > 1.5 * untrained, record
