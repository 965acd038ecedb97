"""Self-distillation at scale (``mode=distill``): the target answers a prompt set once, into resumable shards.

EAGLE-3, Medusa-2 and HASS regenerate their training conversations with the target, because a head is judged on
the target's own continuations. This step does that for tens of thousands of prompts, once, so many heads can
train on the result (``data.train_files=[OUT/t0/shard-*.jsonl]``):

- Every record's assistant turns are dropped and the target answers each user turn in order (multi-turn records
  stay multi-turn, stored as ``messages``; single-turn ones as exact ``prompt_ids`` + ``token_ids``).
- One dataset per configured temperature: ``t0`` (greedy, what a T = 0 runner verifies) and e.g. ``t0.7``.
- Records are shuffled once (seeded) and cut into shards of ``shard_size``; rank r of W answers shards r, r+W, ...
  Each shard is written to a temp file and renamed, so a kill -9 loses at most the shard in flight, and a restart
  skips every shard already on disk (a shard that does not parse back completely is answered again).
- ``OUT/key.json`` names what the answers depend on (target identity, prompts, sampling settings, shard size); a
  directory holding answers for anything else is refused rather than mixed. ``manifest.json`` is written once every
  shard exists: records, tokens, shards.
- A larger or smaller slice of the same prompts (another ``max_records``) gets its own directory, but its shards are
  prefixes of one seeded shuffle, with per-shard seeds: every full shard another slice already answered under the same
  settings is copied from there instead of answered again (``donor_dirs`` checks that slice's prompt hash).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from heads.target import Target, cache_dir
from train import UserError
from train.distill import DistillConfig, _answer_all, prompt_ids, as_question
from train.vllm_answers import ENGINES
from heads.records import Record, read_sources

log = logging.getLogger(__name__)


@dataclass
class RegenConfig:
    files: list[str] = field(default_factory=list)  # prompts in any heads/records.py format; answers are replaced
    exclude_files: list[str] = field(default_factory=list)  # never answered (the held-out prompts)
    max_records: int | None = None  # a seeded random subset: every source is represented, not the first files
    temperatures: list[float] = field(default_factory=lambda: [0.0])  # 0: greedy; one dataset per entry
    top_p: float = 1.0  # sampled answers follow the target's own distribution, as a T > 0 runner verifies
    max_new_tokens: int = 256
    max_prompt_len: int = 1024  # longer prompts are skipped (counted in the manifest): they would not fit max_len
    batch_size: int = 32
    shard_size: int = 256  # what a kill -9 can cost; small enough to lose little, large enough to batch well
    seed: int = 0
    out_dir: str | None = None  # null: ~/.cache/draftheads/distill/<target>-<key hash>
    rank: int | None = None  # null: from the RANK / WORLD_SIZE environment (torchrun), else 0 of 1
    world_size: int | None = None
    engine: str = "builtin"  # builtin: train/distill.py's decode loop; vllm: the engine venv's vLLM (vllm_answers.py)

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise UserError(f"distill.engine={self.engine!r}; choose one of {', '.join(ENGINES)}")


def rank_world(cfg: RegenConfig) -> tuple[int, int]:
    rank = cfg.rank if cfg.rank is not None else int(os.environ.get("RANK", 0))
    world = cfg.world_size if cfg.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise UserError(f"distill.rank={rank} is not in 0..{world - 1}; fix distill.rank / distill.world_size")
    return rank, world


def select(cfg: RegenConfig, everything: list[Record] | None = None) -> list[Record]:
    """The prompts to answer, in the seeded order that defines the shards (a prefix of ``shuffled(cfg)``)."""
    records = shuffled(cfg) if everything is None else everything
    return records[:cfg.max_records] if cfg.max_records else records


def shuffled(cfg: RegenConfig) -> list[Record]:
    """Every prompt in the seeded order; a slice of any size is a prefix of it, so slices share their first shards."""
    if not cfg.files:
        raise UserError("mode=distill needs prompts: set distill.files=[FILE_OR_GLOB, ...]")
    records = read_sources(cfg.files)
    excluded = {r.key() for r in read_sources(cfg.exclude_files)} if cfg.exclude_files else set()
    records = [as_question(r) for r in records if r.key() not in excluded]
    records = [r for r in records if r.needs_answer]
    if not records:
        raise UserError(f"no prompts to answer in {list(cfg.files)}: records need a user turn, 'turns' or 'prompt'")
    random.Random(cfg.seed).shuffle(records)
    return records


def prompts_hash(records: list[Record]) -> str:
    return hashlib.sha256(json.dumps([[r.messages, r.followups, r.prompt] for r in records]).encode()).hexdigest()


def dataset_key(cfg: RegenConfig, target: Target, records: list[Record]) -> dict:
    prompts = prompts_hash(records)
    return {"version": 1, "target": target.identity(), "prompts_sha256": prompts, "records": len(records),
            "temperatures": [float(t) for t in cfg.temperatures], "top_p": cfg.top_p, "seed": cfg.seed,
            "max_new_tokens": cfg.max_new_tokens, "max_prompt_len": cfg.max_prompt_len, "shard_size": cfg.shard_size,
            # another engine writes other answers (sampled: another stream); builtin keeps the keys made before it
            **({"engine": cfg.engine} if cfg.engine != "builtin" else {})}


def write_atomic(path: Path, write, option: str = "distill.out_dir") -> None:
    """``write(binary file)`` into a temp file renamed over ``path``: readers and restarts see all of it or none."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: ranks never share a temp file
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path} ({e.strerror}); free disk space or set {option} elsewhere, "
                        "then run again: finished shards are kept") from e


def keyed_dir(explicit: str | None, kind: str, target: Target, key: dict) -> Path:
    """``explicit`` or ~/.cache/draftheads/<kind>/<target>-<hash of key> (not created)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(explicit) if explicit else cache_dir() / kind / f"{target.name.replace('/', '_')}-{digest}"


def read_key(path: Path) -> dict | None:
    try:
        return json.loads((path / "key.json").read_text())
    except (OSError, ValueError):
        return None


def keyed_dirs(kind: str, target: Target) -> list[tuple[Path, dict]]:
    """(directory, key) of every readable per-key directory of ``kind`` for this target under ~/.cache/draftheads."""
    dirs = sorted(p.parent for p in (cache_dir() / kind).glob(f"{target.name.replace('/', '_')}-*/key.json"))
    return [(d, key) for d in dirs if (key := read_key(d))]


def open_keyed_dir(explicit: str | None, kind: str, target: Target, key: dict, option: str) -> Path:
    """``keyed_dir``, created; a directory made for another key is refused."""
    out = keyed_dir(explicit, kind, target, key)
    out.mkdir(parents=True, exist_ok=True)
    key_file = out / "key.json"
    if key_file.exists():
        old = json.loads(key_file.read_text())
        if old != key:
            diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
            raise UserError(f"{out} was made with other {', '.join(diff)}; delete it or set {option} to another "
                            "directory (null: one per key under ~/.cache/draftheads)")
    else:
        write_atomic(key_file, lambda f: f.write(json.dumps(key, sort_keys=True).encode()), option)
    return out


def write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def write_shard(path: Path, rows: list[dict]) -> None:
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def shard_rows(path: Path, expected: int) -> list[dict] | None:
    """A finished shard's rows, or None when it is missing, truncated or corrupt (it is then answered again)."""
    if not path.exists():
        return None
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    except (json.JSONDecodeError, UnicodeDecodeError):
        rows = []
    if len(rows) != expected:
        log.warning("%s is incomplete or corrupt (%d of %d rows): answering it again", path, len(rows), expected)
        return None
    return rows


def row_of(r: Record, record_id: str) -> dict:
    if r.messages is not None:  # multi-turn: the conversation as text, rendered again by the chat template
        return {"id": record_id, "messages": r.messages}
    return {"id": record_id, "prompt_ids": r.prompt_ids, "token_ids": r.token_ids}


def answer_shard(target: Target, records: list[Record], ids: list[str], dcfg: DistillConfig,
                 max_prompt_len: int, engine=None) -> tuple[list[dict], int]:
    """Rows for one shard (skipped prompts as {"id", "skipped"}) and the number of tokens the target generated."""
    tok = target.tokenizer
    fits = [len(prompt_ids(r, tok)) <= max_prompt_len for r in records]
    todo = [Record(messages=r.messages and list(r.messages), followups=list(r.followups), prompt=r.prompt,
                   where=r.where) for r, ok in zip(records, fits) if ok]
    answered = iter(_answer_all(target, todo, dcfg, (), "distill", engine) if todo else [])
    rows, new_tokens = [], 0
    for r, rid, ok in zip(records, ids, fits):
        if not ok:
            rows.append({"id": rid, "skipped": "prompt longer than distill.max_prompt_len"})
            continue
        a = next(answered)
        rows.append(row_of(a, rid))
        new_tokens += len(a.token_ids) if a.token_ids is not None else count_assistant_tokens(a, tok)
    return rows, new_tokens


def count_assistant_tokens(r: Record, tok) -> int:
    return sum(len(tok(m["content"], add_special_tokens=False).input_ids)
               for m in r.messages if m["role"] == "assistant")


def regenerate(cfg: RegenConfig, target: Target) -> dict:
    """Answer every selected prompt at every configured temperature; returns a summary (also in manifest.json)."""
    with ExitStack() as stack:  # closes the vLLM worker, when one was started, however the run ends
        return answer_all_datasets(cfg, target, stack)


def answer_all_datasets(cfg: RegenConfig, target: Target, stack: ExitStack) -> dict:
    everything = shuffled(cfg)
    records = select(cfg, everything)
    key = dataset_key(cfg, target, records)
    out = open_keyed_dir(cfg.out_dir, "distill", target, key, "distill.out_dir")
    rank, world = rank_world(cfg)
    S = cfg.shard_size
    shards = [list(range(s, min(s + S, len(records)))) for s in range(0, len(records), S)]
    mine = [s for s in range(len(shards)) if s % world == rank]
    donors = None  # looked up only once a full shard still needs its answers
    summary = {"out_dir": str(out), "records": len(records), "engine": cfg.engine, "datasets": {}}
    engine = None  # started at the first shard that needs answering: finished datasets load no vLLM
    for t in cfg.temperatures:
        name = f"t{float(t):g}"
        folder = out / name
        folder.mkdir(exist_ok=True)
        todo = [s for s in mine if shard_rows(folder / f"shard-{s:05d}.jsonl", len(shards[s])) is None]
        full = [s for s in todo if len(shards[s]) == S]
        if full and donors is None:
            donors = donor_dirs(target, key, everything, out)
        copied = [s for s in full if copy_from_donor(donors, name, s, folder, S)]
        todo = [s for s in todo if s not in copied]
        log.info("distill %s: %d prompts in %d shards, rank %d of %d answers %d (%d already done, %d of them copied "
                 "from another slice of the same prompts) into %s", name, len(records), len(shards), rank, world,
                 len(mine), len(mine) - len(todo), len(copied), folder)
        if todo and engine is None and cfg.engine == "vllm":
            from train.vllm_answers import VllmAnswers

            engine = stack.enter_context(VllmAnswers(target, cfg.batch_size, target.dims.max_position_embeddings))
        bar = tqdm(total=sum(len(shards[s]) for s in todo), desc=f"distill {name}", unit="prompt", dynamic_ncols=True)
        t0, generated = time.perf_counter(), 0
        for s in todo:
            dcfg = DistillConfig(max_new_tokens=cfg.max_new_tokens, temperature=float(t), top_p=cfg.top_p,
                                 batch_size=cfg.batch_size, seed=cfg.seed * 1_000_003 + s)
            rows, n = answer_shard(target, [records[i] for i in shards[s]], [records[i].where for i in shards[s]], dcfg,
                                   cfg.max_prompt_len, engine)
            write_shard(folder / f"shard-{s:05d}.jsonl", rows)
            generated += n
            bar.update(len(shards[s]))
            bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - t0):.0f}")
        bar.close()
        elapsed = time.perf_counter() - t0
        summary["datasets"][name] = {"files": str(folder / "shard-*.jsonl"), "generated_tokens_this_run": generated,
                                     "shards_copied": len(copied), "shards_answered": len(todo),
                                     "seconds_this_run": round(elapsed, 1),
                                     "tokens_per_s": round(generated / elapsed, 1) if todo and elapsed else None}
        if todo:
            log.info("distill %s: %d answer tokens in %.0f s = %.1f tokens/s", name, generated, elapsed,
                     generated / max(elapsed, 1e-9))
        write_manifest(folder, shards, key, t)
    return summary


def donor_dirs(target: Target, key: dict, everything: list[Record], out: Path) -> list[tuple[Path, int]]:
    """(directory, full shards) of every other distill directory of this target made with the same settings for a
    slice (a prefix) of ``everything``: its full shard s holds the same prompts, seed and answers as this one's."""
    def settings(k: dict) -> dict:
        return {f: v for f, v in k.items() if f not in ("records", "prompts_sha256")}

    found = []
    for path, old in keyed_dirs("distill", target):
        if path.resolve() == out.resolve() or settings(old) != settings(key):
            continue
        n = old.get("records", 0)
        if 0 < n <= len(everything) and prompts_hash(everything[:n]) == old.get("prompts_sha256"):
            found.append((path, n // key["shard_size"]))
    return found


def copy_from_donor(donors: list[tuple[Path, int]], name: str, s: int, folder: Path, size: int) -> bool:
    """Shard ``s`` copied from a donor that finished it (a copy, not a link: deleting either cache keeps the other)."""
    for path, full in donors:
        src = path / name / f"shard-{s:05d}.jsonl"
        rows = shard_rows(src, size) if s < full else None
        if rows is not None:  # written back as a shard is written: the donor's bytes
            write_shard(folder / src.name, rows)
            log.debug("distill %s: shard %d copied from %s", name, s, path)
            return True
    return False


def write_manifest(folder: Path, shards: list[list[int]], key: dict, temperature: float) -> None:
    """Once every shard exists (whichever rank wrote it): what the dataset holds."""
    rows = [shard_rows(folder / f"shard-{s:05d}.jsonl", len(idx)) for s, idx in enumerate(shards)]
    if any(r is None for r in rows):
        return  # other ranks still answering; the last one to finish writes the manifest
    flat = [row for shard in rows for row in shard]
    manifest = {"key": key, "temperature": temperature, "shards": len(shards), "records": len(flat),
                "skipped": sum("skipped" in r for r in flat),
                "multi_turn": sum("messages" in r for r in flat),
                "answer_tokens": sum(len(r.get("token_ids", [])) for r in flat)}
    write_text(folder / "manifest.json", json.dumps(manifest, indent=1))
