"""Prompts for the runner and its benchmarks: reading them, their validation/test split, and the stop tokens.

A benchmark decodes the test split (heads/splits.py) and compares what it measures with a prediction from the
head's acceptance.json, whose α was measured on the validation split. ``check_unseen`` refuses prompts that α was
measured on: decoding the very text a prediction came from makes the prediction agree by construction.
"""
from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

from heads import chat
from heads.errors import UserError
from heads.records import json_lines
from heads.splits import assign_splits, check_split, prompt_key

log = logging.getLogger(__name__)

SPEC_BENCH_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")  # the rest is MT-bench


def _read(path: Path) -> list[tuple[int, dict]]:
    rows = []
    for i, rec in json_lines(path, "prompts= wants one JSON object per line"):
        if not isinstance(rec, dict):
            raise UserError(f"{path}:{i}: expected a JSON object with 'turns', 'messages' or 'prompt'")
        rows.append((i, rec))
    return rows


def _messages(rec: dict, where: str) -> tuple[list[dict] | None, str | None]:
    """(chat messages, or None for raw text; the raw text, or None)."""
    if "turns" in rec:
        return [{"role": "user", "content": rec["turns"][0]}], None
    if "messages" in rec:
        messages = [m for m in rec["messages"] if m.get("role") in ("system", "user", "assistant")]
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]  # a trailing reference answer
        if not messages:
            raise UserError(f"{where}: 'messages' has no user turn")
        return messages, None
    if "prompt" in rec:
        return None, str(rec["prompt"])
    raise UserError(f"{where}: no 'turns', 'messages' or 'prompt' field (keys: {sorted(rec)})")


def load_prompts(path, tokenizer, chat_template=True, per_category=None, limit=None, split=None,
                 turns: str = "first") -> list[dict]:
    """Spec-Bench ({"question_id", "category", "turns"}), {"messages": [...]} or {"prompt": "..."}.

    -> [{"question_id", "category", "prompt_ids", "key", "split", "messages", "followups"}]. ``split``: only that
    half (validation | test, assigned on the whole file by its raw categories, as train/ assigns it), then
    ``per_category`` per task. ``turns="all"``: a Spec-Bench record's later turns become ``followups``, asked after
    each answer (``next_turn``), as Spec-Bench's own runs and train/'s held-out answers ask them.
    """
    if turns not in ("first", "all"):
        raise UserError(f"turns={turns!r}; choose first or all")
    path = Path(path)
    if not path.exists():
        raise UserError(f"prompts={path}: no such file")
    try:
        check_split(split)
    except ValueError as e:
        raise UserError(str(e)) from e
    rows = _read(path)
    splits = assign_splits(rec.get("category") if isinstance(rec.get("category"), str) else None for _, rec in rows)
    records = []
    for (i, rec), half in zip(rows, splits):
        if split is not None and half != split:
            continue
        messages, raw = _messages(rec, f"{path}:{i}")
        key = prompt_key(next(m["content"] for m in messages if m["role"] != "assistant")) if messages else \
            prompt_key(raw)
        if raw is None and not chat_template:
            raw = "\n\n".join(m["content"] for m in messages)
        if raw is None:
            try:
                text = chat.render(tokenizer, messages, add_generation_prompt=True)
            except chat.MissingChatTemplate as e:
                raise UserError(f"{e} (or chat_template=false here)") from e
            ids = tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = tokenizer(raw).input_ids
        category = rec.get("category", "")
        task = "mt_bench" if "turns" in rec and category not in SPEC_BENCH_TASKS else category
        later = rec["turns"][1:] if turns == "all" and "turns" in rec and raw is None else []
        records.append({"question_id": rec.get("question_id", rec.get("id", i)), "category": task,
                        "prompt_ids": ids, "key": key, "split": half, "messages": messages,
                        "followups": [str(t) for t in later]})
    if per_category:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for r in records:
            if seen[r["category"]] < per_category:
                kept.append(r)
                seen[r["category"]] += 1
        records = kept
    records = records[:limit] if limit else records
    if not records:
        raise UserError(f"prompts={path}: no prompts" + (f" in the {split} split" if split else ""))
    return records


def next_turn(messages: list[dict], answer: list[int], followup: str, tokenizer, stops) -> tuple[list[dict], list]:
    """The conversation after ``answer`` (token ids, its stop token dropped) and the next user turn, and its prompt
    ids: the answer goes back as text and the whole conversation is rendered again, as train/distill.py does for
    the held-out answers, so a multi-turn record's later prompts are the text its α was measured on."""
    text = tokenizer.decode(answer[:-1] if answer and answer[-1] in stops else answer, skip_special_tokens=True)
    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": followup}]
    rendered = chat.render(tokenizer, messages, add_generation_prompt=True)
    return messages, tokenizer(rendered, add_special_tokens=False).input_ids


def measured_prompts(prompts: list[dict], acceptance_path, split: str | None) -> list[dict]:
    """The prompts an acceptance.json's α was measured on in ``split`` (test when None), in file order: decoding
    them all turns, T = 0, gives the τ that its ``tau_predicted`` (test) or validation prediction walks."""
    path = Path(acceptance_path)
    if not path.exists():
        raise UserError(f"alpha_prompts={path}: no such file; give the acceptance.json of a train/ run")
    keys = json.loads(path.read_text()).get("heldout_prompt_keys")
    if keys is None:
        raise UserError(f"alpha_prompts={path} lists no held-out prompts (written before the validation/test split);"
                        " re-measure it with train/main.py mode=eval")
    wanted = set(keys.get(split or "test", []))
    kept = [p for p in prompts if p["key"] in wanted]
    if len(kept) < len(wanted):
        raise UserError(f"alpha_prompts={path}: {len(wanted) - len(kept)} of its {len(wanted)} {split or 'test'} "
                        "prompts are not in prompts=; give the file its α was measured on")
    return kept


def check_unseen(prompts: list[dict], acceptance_path: Path | None) -> str:
    """Refuse prompts whose α the head's acceptance.json was measured on (its validation split). Returns what was
    checked: "unseen", or "unknown" for an acceptance.json written before it recorded its prompts."""
    if acceptance_path is None:
        return "no acceptance.json"
    record = json.loads(Path(acceptance_path).read_text())
    keys = record.get("heldout_prompt_keys")
    if keys is None:
        log.warning("%s does not list the prompts its α was measured on (written before the validation/test split): "
                    "the benchmark cannot check that its prompts are unseen", acceptance_path)
        return "unknown"
    seen = set(keys.get(record.get("split", "validation"), []))
    overlap = [p["question_id"] for p in prompts if p["key"] in seen]
    if overlap:
        raise UserError(f"{len(overlap)} benchmark prompts (question_id {overlap[:5]}) are the text {acceptance_path}'s "
                        "α was measured on, so its prediction would match by construction; decode the test split "
                        "(split=test / --split test) or re-measure α with mode=eval")
    return "unseen"


def stop_ids(tokenizer, model_config) -> set[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(model_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return {i for i in ids if i is not None}
