"""Read training and held-out data into one normalised ``Record`` type, whatever the source format.

Formats (detected per record from its keys, so one list of files may mix them):
  chat        {"messages": [{"role", "content"}, ...]}          ../shared/data/train, UltraChat-200k
  sharegpt    {"conversations": [{"from", "value"}, ...]}        ShareGPT / Vicuna
  ultrachat   {"data": ["user turn", "assistant turn", ...]}     the original UltraChat release
  turns       {"turns": ["user turn", ...]}                      MT-bench / Spec-Bench questions (prompts only)
  text        {"text": ...} or a .txt file of blank-line-separated paragraphs (TinyStories)
  prompt      {"prompt": ...}                                    a plain-text opening the target continues
  generations {"prompt_ids": [...], "token_ids": [...]}          what serve/ writes to OUT/generations.jsonl
A record without an answer (a chat ending on a user turn, ``turns``, ``prompt``) is answered by the target itself
(train/distill.py). Entries of ``train_files`` / ``eval_files`` are paths (globs allowed; relative paths resolve
against the current directory, then the repo root) or ``hub:NAME[:SPLIT]`` for ``datasets.load_dataset``.
"""
from __future__ import annotations

import glob
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from heads.errors import UserError
from heads.splits import SPLITS, assign_splits, prompt_key

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass
class Record:
    messages: list[dict] | None = None  # chat: [{"role", "content"}]; may end on a user turn (answer pending)
    followups: list[str] = field(default_factory=list)  # further user turns, asked after each generated answer
    text: str | None = None  # plain text, every token trained
    prompt: str | None = None  # plain-text opening whose continuation the target writes
    prompt_ids: list[int] | None = None  # pre-tokenised: prompt_ids + token_ids, token_ids trained
    token_ids: list[int] | None = None
    where: str = ""  # "file:line" for error messages
    category: str | None = None  # e.g. Spec-Bench's "category": α is also reported per category
    split: str | None = None  # held-out records: "validation" (tuned on) or "test" (reported; heads/splits.py)
    features: dict | None = None  # target hidden states k -> [T, H] kept from generation (never saved)
    asked_key: str | None = None  # key() of the question a generated answer came from (answers keep their prompt's)

    @property
    def needs_answer(self) -> bool:
        if self.messages is not None:
            return self.messages[-1]["role"] != "assistant" or bool(self.followups)
        return self.prompt is not None

    def key(self) -> str:
        """Content hash of the *prompt*, so a held-out prompt is recognised in training data whatever its answer."""
        if self.asked_key is not None:
            return self.asked_key
        if self.messages is not None:  # the first non-assistant turn, as serve/ keys its prompts
            first = [m["content"] for m in self.messages if m["role"] != "assistant"][:1]
            if first:
                return prompt_key(first[0])
            body = json.dumps(first)
        elif self.prompt_ids is not None:
            body = json.dumps(self.prompt_ids)
        else:
            body = self.text if self.text is not None else self.prompt
        return hashlib.sha1(body.encode()).hexdigest()


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: every message needs string 'role' and 'content'; got {str(m)[:80]}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _alternating(turns, where: str) -> list[dict]:
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise UserError(f"{where}: 'data' must be a list of strings (user, assistant, user, ...)")
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def parse_record(obj, where: str) -> Record:
    record = _parse(obj, where)
    if isinstance(obj.get("category"), str):
        record.category = obj["category"]
    return record


def _parse(obj, where: str) -> Record:
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
    if "prompt_ids" in obj or "token_ids" in obj:
        p, t = obj.get("prompt_ids"), obj.get("token_ids")
        if not (isinstance(p, list) and isinstance(t, list) and all(isinstance(i, int) for i in p + t)):
            raise UserError(f"{where}: 'prompt_ids' and 'token_ids' must both be lists of ints")
        return Record(prompt_ids=p, token_ids=t, where=where)
    if "messages" in obj:
        return Record(messages=_check_messages(obj["messages"], where), where=where)
    if "conversations" in obj:
        conv = obj["conversations"]
        if not isinstance(conv, list) or not conv:
            raise UserError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}")
        try:
            messages = [{"role": SHAREGPT_ROLES[c["from"].lower()], "content": c["value"]} for c in conv]
        except (KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{where}: ShareGPT turns need 'from' in {sorted(SHAREGPT_ROLES)} and 'value' ({e})") from e
        return Record(messages=_check_messages(messages, where), where=where)
    if "data" in obj:
        return Record(messages=_alternating(obj["data"], where), where=where)
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise UserError(f"{where}: 'turns' must be a non-empty list of strings")
        return Record(messages=[{"role": "user", "content": turns[0]}], followups=list(turns[1:]), where=where)
    for key in ("text", "prompt"):
        if key in obj:
            if not isinstance(obj[key], str) or not obj[key].strip():
                raise UserError(f"{where}: '{key}' must be a non-empty string")
            return Record(**{key: obj[key]}, where=where)
    raise UserError(f"{where}: unrecognised record with keys {sorted(obj)[:6]}; expected one of messages, "
                    "conversations, data, turns, text, prompt, or prompt_ids + token_ids")


def resolve_paths(entry: str) -> list[Path]:
    """A path or glob, relative to the current directory or else the repo root; missing -> one-line error."""
    for base in (Path.cwd(), REPO_ROOT):
        pattern = str(Path(entry).expanduser() if Path(entry).is_absolute() else base / entry)
        matches = sorted(glob.glob(pattern))
        if matches:
            return [Path(m) for m in matches]
    raise UserError(f"data file {entry!r} not found (nor under {REPO_ROOT}); fix data.train_files / data.eval_files")


def json_lines(path: Path, fix: str) -> Iterator[tuple[int, object]]:
    """(line number, object) per non-blank line of a JSON-lines file; a line that is not JSON is one UserError
    ending in ``fix``."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg}); {fix}") from e
            yield lineno, obj


def read_file(path: Path) -> list[Record]:
    if path.suffix == ".txt":
        paragraphs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n")]
        records = [Record(text=p, where=f"{path}:paragraph {i}") for i, p in enumerate(paragraphs, 1) if p]
    else:
        records = []
        for lineno, obj in json_lines(path, "fix or remove that line"):
            if isinstance(obj, dict) and "skipped" in obj:
                continue  # a prompt mode=distill left unanswered (too long), kept so its shard stays complete
            records.append(parse_record(obj, f"{path}:{lineno}"))
    if not records:
        raise UserError(f"{path}: no records (empty file); point data.train_files / data.eval_files at real data")
    return records


def read_hub(spec: str, limit: int | None) -> list[Record]:
    """``hub:NAME[:SPLIT]`` through ``datasets.load_dataset`` (a hub id, or a local directory of data files)."""
    import datasets

    name, _, split = spec[len("hub:"):].partition(":")
    try:
        rows = datasets.load_dataset(name, split=split or "train", streaming=limit is not None)
    except Exception as e:  # network, auth, unknown split: say which and how to fix
        raise UserError(f"cannot load {spec} with datasets.load_dataset ({type(e).__name__}: {str(e)[:200]}); "
                        "check the name/split and network, or use local files") from e
    records = []
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        records.append(parse_record(dict(row), f"{spec}[{i}]"))
    if not records:
        raise UserError(f"{spec}: no records")
    return records


def read_sources(entries, limit: int | None = None) -> list[Record]:
    records: list[Record] = []
    for entry in entries or []:
        entry = str(entry)
        if entry.startswith("hub:"):
            records += read_hub(entry, limit)
        else:
            for path in resolve_paths(entry):
                records += read_file(path)
    return records


def in_heldout(record: Record, fraction: float) -> bool:
    """A stable split by content hash: the same prompt is held out on every machine and in every run."""
    return int(record.key()[:8], 16) % 10_000 < fraction * 10_000


def split_records(train_files, eval_files, heldout_fraction: float, max_train: int | None, max_eval: int | None,
                  seed: int) -> tuple[list[Record], list[Record]]:
    """(train, held-out) records. Held-out = eval_files, or a hashed slice of train_files; never trained on. Each
    held-out record gets its ``split`` (heads/splits.py), assigned on the whole held-out list before ``max_eval``
    caps each split alone (round-robin over categories, so every category is represented in both)."""
    train = read_sources(train_files)
    if eval_files:
        heldout = read_sources(eval_files)
        held_keys = {r.key() for r in heldout}
        train = [r for r in train if r.key() not in held_keys]  # an eval prompt inside train data is dropped
    else:
        heldout = [r for r in train if in_heldout(r, heldout_fraction)]
        train = [r for r in train if not in_heldout(r, heldout_fraction)]
    for record, split in zip(heldout, assign_splits(r.category for r in heldout)):
        record.split = split
    rng = random.Random(seed)  # subsample deterministically: the same subset on every rank and every resume
    if max_train is not None and len(train) > max_train:
        train = rng.sample(train, max_train)
    if max_eval is not None:
        heldout = [r for split in SPLITS for r in round_robin([r for r in heldout if r.split == split], max_eval)]
    overlap = {r.key() for r in train} & {r.key() for r in heldout}
    assert not overlap, f"{len(overlap)} held-out prompts are also training prompts"
    return train, heldout


def round_robin(records: list[Record], limit: int) -> list[Record]:
    """The first ``limit`` records taking one of each category in turn, in file order within a category."""
    seen: dict = {}
    rank = [seen.setdefault(r.category, []).append(r) or len(seen[r.category]) for r in records]
    return [r for _, _, r in sorted(zip(rank, range(len(records)), records))][:limit]


def reference_records(files, heldout: list[Record], max_records: int | None, seed: int) -> list[Record]:
    """The records of ``files`` that carry their own answers, minus the held-out prompts, a seeded sample of
    ``max_records`` (its own stream: the distilled slice's sample does not move when this one is resized)."""
    held = {r.key() for r in heldout}
    records = [r for r in read_sources(files) if not r.needs_answer and r.key() not in held]
    if max_records is not None and len(records) > max_records:
        records = random.Random(seed + 1).sample(records, max_records)
    return records
