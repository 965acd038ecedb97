"""heads/records.py + train/data.py: formats, assistant-only masks from the chat template, splits, batches."""
from __future__ import annotations

import json

import pytest
import torch

from train import UserError
from train.data import (DataConfig, DraftDataModule, LengthGroupedBatches, chat_example, collate, ids_example,
                        text_example, token_counts)
from heads.records import read_sources, split_records

CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "Four times three is twelve."},
]


def trained_text(example, tokenizer) -> str:
    """The tokens the mask trains on: loss_mask[t] trains token t+1."""
    return tokenizer.decode(example.input_ids[1:][example.loss_mask[:-1]])


def check_assistant_only(tokenizer):
    ex = chat_example(CONVERSATION, tokenizer, max_len=4096)
    trained = trained_text(ex, tokenizer)
    for m in CONVERSATION:
        assert (m["content"] in trained) == (m["role"] == "assistant"), (m, trained)
    # exactly the assistant turns as the (ChatML) template renders them, end-of-turn marker included
    assert trained == "Two plus two is four.<|im_end|>\nFour times three is twelve.<|im_end|>\n"
    assert not ex.loss_mask[-1]


def test_chat_mask_tiny_random(tiny_target):
    check_assistant_only(tiny_target.tokenizer)


@pytest.mark.slow
def test_chat_mask_smollm2():
    """SmolLM2's template injects a system prompt: still only the assistant turns are trained."""
    from transformers import AutoTokenizer

    from heads.target import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("smollm2-135m", None))
    check_assistant_only(tok)
    ex = chat_example(CONVERSATION, tok, 4096)
    assert "You are a helpful AI assistant" in tok.decode(ex.input_ids)
    assert "helpful AI assistant" not in trained_text(ex, tok)


def test_text_and_generations_masks(tiny_target):
    ex = text_example("Once upon a time", tiny_target.tokenizer, 512)
    assert ex.loss_mask[:-1].all() and not ex.loss_mask[-1]
    ex = ids_example([5, 6, 7], [8, 9], 512)  # prompt 5 6 7, generated 8 9
    assert ex.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert ex.loss_mask.tolist() == [False, False, True, True, False]  # positions predicting 8 and 9


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_formats_read_the_same_conversation(tmp_path, tiny_target):
    user, bot = "Name a colour.", "Blue is a colour."
    files = {
        "chat": {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": bot}]},
        "sharegpt": {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": bot}]},
        "ultrachat": {"data": [user, bot]},
    }
    examples = {}
    for name, row in files.items():
        (record,) = read_sources([str(write_jsonl(tmp_path / f"{name}.jsonl", [row]))])
        examples[name] = chat_example(record.messages, tiny_target.tokenizer, 512)
    for ex in examples.values():
        assert torch.equal(ex.input_ids, examples["chat"].input_ids)
        assert torch.equal(ex.loss_mask, examples["chat"].loss_mask)
    (turns,) = read_sources([str(write_jsonl(tmp_path / "q.jsonl", [{"turns": ["a?", "b?"]}]))])
    assert turns.needs_answer and turns.followups == ["b?"]
    gen = read_sources([str(write_jsonl(tmp_path / "g.jsonl", [{"prompt_ids": [1, 2], "token_ids": [3]}]))])
    assert gen[0].token_ids == [3] and not gen[0].needs_answer


def test_hub_path_reads_through_datasets(tmp_path):
    """``hub:NAME`` goes through datasets.load_dataset; a local directory of ShareGPT-format files stands in."""
    hub = tmp_path / "sharegpt_like"
    hub.mkdir()
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(5)]
    write_jsonl(hub / "train.jsonl", rows)
    records = read_sources([f"hub:{hub}:train"])
    assert [r.messages[1]["content"] for r in records] == [f"a{i}" for i in range(5)]


def test_text_file_paragraphs(tmp_path):
    path = tmp_path / "stories.txt"
    path.write_text("First story here.\nSecond line.\n\nSecond story.\n\n\n")
    assert [r.text for r in read_sources([str(path)])] == ["First story here.\nSecond line.", "Second story."]


def test_heldout_never_trained(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "ok"}]}
            for i in range(200)]
    path = str(write_jsonl(tmp_path / "all.jsonl", rows))
    train, heldout = split_records([path], [], 0.2, None, None, 0)
    assert 20 < len(heldout) < 60 and len(train) + len(heldout) == 200
    assert not {r.key() for r in train} & {r.key() for r in heldout}
    assert [r.key() for r in heldout] == [r.key() for r in split_records([path], [], 0.2, None, None, 1)[1]]
    # an eval file that repeats training prompts: those prompts leave the training set
    eval_path = str(write_jsonl(tmp_path / "eval.jsonl", rows[:10]))
    train, heldout = split_records([path], [eval_path], 0.0, None, None, 0)
    assert len(heldout) == 10 and len(train) == 190


def test_token_counts_only_trained_tokens():
    ex = ids_example([5, 6], [7, 7, 8], 512)
    counts = token_counts([ex], 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 0, 2, 1, 0]


def test_collate_right_pads():
    a, b = ids_example([1, 2], [3], 512), ids_example([4], [5, 6, 7], 512)
    batch = collate([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert not batch["loss_mask"][0, 2:].any()


def test_batches_shard_and_resume():
    lengths = [5 + (i * 7) % 50 for i in range(100)]
    full = LengthGroupedBatches(lengths, 4, seed=3)
    full.set_epoch(2)
    order = list(full)
    assert len(order) == 25 and sorted(i for b in order for i in b) == list(range(100))
    resumed = LengthGroupedBatches(lengths, 4, seed=3)
    resumed.set_epoch(2)
    resumed.skip = 10
    assert list(resumed) == order[10:]
    assert list(resumed) == order  # the skip applies to one epoch only
    shards = [list(LengthGroupedBatches(lengths, 4, seed=3, rank=r, world=2)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 12
    assert not {i for b in shards[0] for i in b} & {i for b in shards[1] for i in b}


@pytest.mark.parametrize("content,message", [
    ("", "no records"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [oops\n', ":2: not valid JSON"),
    ('{"question": "hi"}\n', "unrecognised record"),
    ('{"messages": [{"role": "user"}]}\n', "string 'role' and 'content'"),
])
def test_bad_data_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message) as e:
        read_sources([str(path)])
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_missing_file_error():
    with pytest.raises(UserError, match="not found.*data.train_files"):
        read_sources(["no/such/file.jsonl"])


def test_no_assistant_tokens_is_an_error(tmp_path, tiny_target):
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "hello " * 50}]}] * 4)
    cfg = DataConfig(train_files=[str(path)], eval_files=[str(path)], max_len=8)  # the answer is cut away
    with pytest.raises(UserError, match="raise data.max_len"):
        DraftDataModule(cfg, tiny_target).prepare()


def test_self_distillation_answers_and_caches(tmp_path, tiny_target, monkeypatch):
    """Prompt-only records are answered by the target; a second run reads the cache instead of sampling."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"Say {i}."}]}
                                                 for i in range(6)] + [{"prompt": "Once upon"}])
    cfg = DataConfig.from_dict({"train_files": [str(prompts)], "heldout_fraction": 0.3,
                                "distill": {"max_new_tokens": 6, "batch_size": 4, "samples_per_prompt": 2}})
    data = DraftDataModule(cfg, tiny_target)
    data.prepare()
    n_train, n_eval = len(data.train_examples), len(data.eval_examples)
    assert n_eval >= 1 and n_train >= 2 and n_train % 2 == 0  # two samples per training prompt
    assert all(ex.loss_mask.any() for ex in data.train_examples + data.eval_examples)
    cached = sorted((tmp_path / "cache" / "data").glob("*.jsonl"))
    assert len(cached) == 2
    import train.distill

    monkeypatch.setattr(train.distill, "sample", lambda *a, **k: pytest.fail("answers should come from the cache"))
    again = DraftDataModule(cfg, tiny_target)
    again.prepare()
    assert [ex.input_ids.tolist() for ex in again.train_examples] == [ex.input_ids.tolist() for ex in data.train_examples]


def test_reference_files_train_as_written_beside_answered_prompts(tmp_path, tiny_target, monkeypatch):
    """reference_files: records with answers are trained on as written (never re-answered), prompt-only ones and
    held-out prompts are left out, and max_reference_records caps a seeded sample of what is left."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"Say {i}."}]}
                                                 for i in range(3)])
    answered = [{"messages": [{"role": "user", "content": f"Count to {i}."},
                              {"role": "assistant", "content": f"reference answer {i}"}]} for i in range(12)]
    reference = write_jsonl(tmp_path / "ref.jsonl", answered + [{"messages": [{"role": "user", "content": "Hi?"}]}])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"messages": [{"role": "user", "content": "Count to 0."}]},
                                                 {"messages": [{"role": "user", "content": "Say 9."}]}])
    base = {"train_files": [str(prompts)], "eval_files": [str(held)], "reference_files": [str(reference)],
            "distill": {"max_new_tokens": 4, "batch_size": 4, "samples_per_prompt": 1}}
    import train.distill

    data = DraftDataModule(DataConfig.from_dict(base), tiny_target)
    data.prepare()
    texts = [tiny_target.tokenizer.decode(ex.input_ids) for ex in data.reference_examples]
    assert len(data.train_examples) == 3 + 11 and len(texts) == 11  # "Count to 0." is held out, "Hi?" has no answer
    assert sorted(int(t.split("reference answer ")[1][:2].strip("<")) for t in texts) == list(range(1, 12))
    assert all(data.train_examples[-11 + i] is ex for i, ex in enumerate(data.reference_examples))
    monkeypatch.setattr(train.distill, "sample", lambda *a, **k: pytest.fail("reference answers are not re-answered"))
    capped = [DraftDataModule(DataConfig.from_dict({**base, "max_reference_records": 4}), tiny_target)
              for _ in range(2)]
    for d in capped:
        d.prepare()  # the training prompts' answers now come from the cache, so sample() is never called
    assert [len(d.reference_examples) for d in capped] == [4, 4]
    assert [e.input_ids.tolist() for e in capped[0].reference_examples] == \
        [e.input_ids.tolist() for e in capped[1].reference_examples]
    # The job's seed (a second head initialisation) keeps the text; data.seed draws another sample.
    job_seed = DraftDataModule(DataConfig.from_dict({**base, "max_reference_records": 4}), tiny_target, seed=1)
    data_seed = DraftDataModule(DataConfig.from_dict({**base, "max_reference_records": 4, "seed": 1}), tiny_target)
    for d in (job_seed, data_seed):
        d.prepare()
    ids = lambda d: [e.input_ids.tolist() for e in d.reference_examples]  # noqa: E731
    assert ids(job_seed) == ids(capped[0])
    assert ids(data_seed) != ids(capped[0]) and len(ids(data_seed)) == 4


def test_features_kept_during_generation_match_a_forward_pass(tmp_path, tiny_target, monkeypatch):
    """The hidden states the decode loop keeps are the ones a fresh forward over the final sequence computes."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "Say " + "a" * i}]}
                                                 for i in range(5)])
    import train.distill
    from train.distill import DistillConfig, answer

    monkeypatch.setattr(train.distill, "stop_ids", lambda target: list(range(120)))  # rows stop at different steps
    cfg = DistillConfig(max_new_tokens=7, batch_size=3)  # batches of 3: left padding and dropped rows both occur
    records = answer(read_sources([str(prompts)]), tiny_target, cfg, layers=(2, 5, 8))
    assert all(r.features is not None for r in records)
    assert len({len(r.token_ids) for r in records}) > 1
    for r in records:
        ids = torch.tensor([r.prompt_ids + r.token_ids])
        want = tiny_target.features(ids, layers=(2, 5))
        for k in (2, 5, 8):
            assert r.features[k].shape == (ids.shape[1], tiny_target.dims.hidden_size)
            torch.testing.assert_close(r.features[k], want.hidden[k][0], atol=1e-4, rtol=1e-4)


def test_answering_cost_is_measured_once_and_read_back_from_the_cache(tmp_path, tiny_target, monkeypatch):
    """What the training text cost to write travels with the cache, so a run that reads it still reports it."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"Count to {i}"}]}
                                                 for i in range(4)])
    from train.distill import DistillConfig, answer

    cfg = DistillConfig(max_new_tokens=5, batch_size=2, samples_per_prompt=2)
    fresh, cached = [], []
    first = answer(read_sources([str(prompts)]), tiny_target, cfg, costs=fresh)
    again = answer(read_sources([str(prompts)]), tiny_target, cfg, costs=cached)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert len(fresh) == 1 and fresh[0]["answers"] == 8 and fresh[0]["cpu_seconds"] > 0
    assert cached == fresh and (tmp_path / "cache" / "data" / fresh[0]["file"]).exists()


@pytest.mark.shared
@pytest.mark.slow  # parses all ~38k training records
def test_chat_config_reads_shared_data(compose, tmp_path):
    """data=chat: ../shared's training JSONL (answers included) and Spec-Bench prompts held out (answered later)."""
    from omegaconf import OmegaConf

    from tests.conftest import require_shared

    require_shared("data", "train")
    cfg = DataConfig.from_dict(OmegaConf.to_container(compose(tmp_path, "data=chat").data, resolve=True))
    train_records, heldout = split_records(cfg.train_files, cfg.eval_files, cfg.heldout_fraction, 200,
                                           cfg.max_eval_records, 0)
    assert len(train_records) == 200  # max_eval_records caps each split: validation and test
    assert [sum(r.split == s for r in heldout) for s in ("validation", "test")] == [cfg.max_eval_records] * 2
    assert sum(not r.needs_answer for r in train_records) > 190  # nearly every training record has its answer
    assert all(r.needs_answer and r.messages[0]["role"] == "user" for r in heldout)  # the target will answer


def test_short_validation_split_gives_every_rank_a_batch(tiny_target, chat_files, monkeypatch):
    """4 validation sequences (8 held out, halved) over 2 or 3 ranks: each rank gets some, none twice, none lost;
    more ranks than sequences is one line naming the fix."""
    data = DraftDataModule(DataConfig(train_files=[str(chat_files[0])], eval_files=[str(chat_files[1])],
                                      eval_batch_size=8), tiny_target)
    data.prepare()
    n = len(data.eval_examples)
    assert n == 4
    for world in (2, 3):
        seen = []
        for rank in range(world):
            monkeypatch.setattr(data, "_rank_world", lambda r=rank, w=world: (r, w))
            seen.append([ids.tolist() for b in data.val_dataloader() for ids in b["input_ids"]])
        assert all(seen) and sum(map(len, seen)) == n
    monkeypatch.setattr(data, "_rank_world", lambda: (0, 5))
    with pytest.raises(UserError, match="fewer devices"):
        data.val_dataloader()
