"""The held-out validation/test split (heads/splits.py): the same in train/ and serve/, and the kept head is chosen
on validation before the test split is measured."""
from __future__ import annotations

import json
from collections import Counter

import pytest

import train.data
import train.selection
from heads.splits import assign_splits
from tests.conftest import require_shared
from train.main import run as run_train
from heads.records import split_records


def test_assign_splits_halves_every_category_in_file_order():
    cats = ["a", "b", "a", None, "a", "b", None, "a", "c"]
    splits = assign_splits(cats)
    assert splits == ["validation", "validation", "test", "validation", "validation", "test", "test", "test",
                      "validation"]
    for c in set(cats):
        n = Counter(s for s, x in zip(splits, cats) if x == c)
        assert abs(n["validation"] - n["test"]) <= 1


@pytest.mark.shared
def test_spec_bench_splits_agree_between_train_and_serve(tiny_target):
    from serve.prompts import load_prompts

    path = str(require_shared("data", "eval", "spec_bench", "question.jsonl"))
    _, heldout = split_records([], [path], 0.0, None, 52, 0)
    by_split = {s: [r for r in heldout if r.split == s] for s in ("validation", "test")}
    assert [len(v) for v in by_split.values()] == [52, 52]
    for records in by_split.values():  # 13 categories, 4 each: the round-robin ran inside each split
        assert set(Counter(r.category for r in records).values()) == {4}
    keys = {s: {r.key() for r in v} for s, v in by_split.items()}
    assert not keys["validation"] & keys["test"]
    served = {p["key"] for p in load_prompts(path, tiny_target.tokenizer, split="test")}
    assert len(served) == 240 and keys["test"] <= served and not keys["validation"] & served


def test_head_is_chosen_on_validation_and_reported_on_test(fast_cfg, tmp_path, monkeypatch):
    """The order of events: validation measured, the head chosen, only then the test split measured; acceptance.json
    holds both, on disjoint prompts."""
    events = []
    loaders, choice = train.data.DraftDataModule.eval_loaders, train.selection.final_choice

    def spy_loaders(self, split="validation"):
        events.append(split)
        return loaders(self, split)

    def spy_choice(*args, **kwargs):
        events.append("choice")
        return choice(*args, **kwargs)

    monkeypatch.setattr(train.data.DraftDataModule, "eval_loaders", spy_loaders)
    monkeypatch.setattr(train.selection, "final_choice", spy_choice)
    out = tmp_path / "run"
    record = run_train(fast_cfg("head=eagle", "trainer.val_check_interval=2", out=out))
    assert events == ["validation", "choice", "test"]
    saved = json.loads((out / "acceptance.json").read_text())
    assert saved["split"] == "validation" and saved["test"]["num_tokens"] > 0
    assert len(saved["test"]["alpha"]) == len(saved["alpha"]) == len(record["test"]["alpha"])
    keys = saved["heldout_prompt_keys"]
    assert keys["validation"] and keys["test"] and not set(keys["validation"]) & set(keys["test"])
    assert saved["test"]["num_tokens"] != saved["num_tokens"]  # other text, not the validation figures copied


def test_heldout_keys_list_the_prompts_alpha_was_measured_on(fast_cfg, write_chat, tmp_path, tiny_target):
    """A held-out prompt that fills data.max_len leaves no answer token to measure, so acceptance.json does not list
    it; the target's own answers keep their prompt's key; serve/'s alpha_prompts= picks exactly the listed ones."""
    from heads.splits import prompt_key
    from serve.prompts import load_prompts, measured_prompts

    heldout = tmp_path / "heldout.jsonl"
    rows = [json.loads(line) for line in write_chat(tmp_path / "chat.jsonl", n=8, seed=5).read_text().splitlines()]
    rows[3]["messages"][0]["content"] = "Tell me everything. " * 200  # a test-split prompt past max_len=64
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows))
    asked = [prompt_key(r["messages"][0]["content"]) for r in rows]
    for respond in ("auto", "target"):  # the file's answers, then the target's own (self-distilled, cached)
        out = tmp_path / respond
        run_train(fast_cfg("head=medusa", "trainer.max_steps=2", "data.max_len=64", f"data.respond={respond}",
                           "data.distill.max_new_tokens=8", f"data.eval_files=[{heldout}]", out=out))
        written = json.loads((out / "acceptance.json").read_text())
        keys = written["heldout_prompt_keys"]
        assert keys == {"validation": asked[0::2], "test": [asked[1], asked[5], asked[7]]}
        assert written["text_by_temperature"]["0.0"].endswith("α on the 7 with answer tokens inside data.max_len=64")
    served = measured_prompts(load_prompts(heldout, tiny_target.tokenizer), out / "acceptance.json", "test")
    assert [p["key"] for p in served] == keys["test"]
    with pytest.raises(Exception, match="1 of its 3 test prompts are not in prompts="):
        measured_prompts(load_prompts(heldout, tiny_target.tokenizer, limit=6), out / "acceptance.json", "test")
