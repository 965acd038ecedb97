"""Self-distillation: the target answers prompts itself, so the head trains on what it will draft for at serve time.

A draft head is judged on the target's *own* continuations (that is what speculative decoding verifies), so the
best training text is the target's samples, not someone else's reference answers (EAGLE-3, Medusa-2 and HASS
regenerate their data for this reason). Answers are sampled in batches with a KV cache and cached under
``~/.cache/draftheads/data/<target>-<split>-<hash>.jsonl`` (keyed by the target's identity, the prompts and the
sampling settings) in the generations format serve/ also writes: exact ``prompt_ids`` + ``token_ids``.

The decode loop already computes the target's hidden states of every token it reads, so when asked (``layers``) it
keeps the ones the head needs: the training set's features then cost no second pass over the target.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import DynamicCache

from heads import chat
from heads.sampling import probs_from_logits
from heads.target import Target, cache_dir
from train.kv_cache import RowCache
from heads.records import Record

log = logging.getLogger(__name__)


@dataclass
class DistillConfig:
    max_new_tokens: int = 192  # long enough for a paragraph-sized answer; each extra token costs a decode step
    temperature: float = 0.7  # sampled, not greedy: greedy answers of small models loop and inflate α
    top_p: float = 0.95
    samples_per_prompt: int = 1  # >1 multiplies training text from few prompts (different samples, same prompt)
    batch_size: int = 32
    seed: int = 0


def stop_ids(target: Target) -> list[int]:
    ids = {target.tokenizer.eos_token_id}
    extra = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return sorted(i for i in ids if i is not None)


def _seed(cfg: DistillConfig, i: int) -> int:
    return cfg.seed * 1_000_003 + i  # prompt i's own stream: its sample never depends on which batch it shares


@torch.no_grad()
def prefill(model, ids: list[int], cache: RowCache, row: int, room: int, layers=()):
    """The prompt alone (no padding: exactly what a one-prompt run computes), copied into ``row`` of ``cache``.
    Returns the logits of its next token and, when ``layers`` is non-empty, the prompt's hidden states."""
    device = next(model.parameters()).device
    alone = DynamicCache()
    out = model(input_ids=torch.tensor([ids], device=device), cache=alone, use_cache=True,
                output_hidden_states=bool(layers), logits_to_keep=1)  # the lm_head only where we sample
    cache.put(row, alone, room)
    return out.logits[0, -1], {k: out.hidden_states[k][0] for k in layers}


def draw(logits: torch.Tensor, cfg: DistillConfig, gens: list[torch.Generator | None]) -> list[int]:
    """One token per row of [B, V] logits; each row draws from its own prompt's generator."""
    if cfg.temperature <= 0:
        return logits.argmax(-1).tolist()  # what multinomial on probs_from_logits' one-hot would pick
    probs = probs_from_logits(logits, cfg.temperature, 0, cfg.top_p)
    return [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, gens)]


@torch.no_grad()
def sample(model, prompts: list[list[int]], cfg: DistillConfig, stop: list[int], pad_id: int, layers=(),
           desc: str = "sampling"):
    """Continuous batching: ``batch_size`` rows decode together, and a row whose answer ended takes the next prompt
    (prompts go in by length, so rows sharing a step have similar lengths and attention spans).

    Every prompt's answer is the one it gets decoded alone: its prefill runs alone, its decode steps see only its
    own slots (train/kv_cache.py), and a sampled token comes from the prompt's own generator (seed from
    ``cfg.seed`` and its index). Returns (new tokens per prompt, the stop token included when reached; and when
    ``layers`` is non-empty, per prompt {k: [len(prompt) + len(new), H]}, i.e. HF ``hidden_states[k]`` of every
    token).
    """
    device = next(model.parameters()).device
    queue = deque(sorted(range(len(prompts)), key=lambda i: len(prompts[i])))
    tokens: list[list[int]] = [[] for _ in prompts]
    hidden: list[dict[int, list[torch.Tensor]]] = [{k: [] for k in layers} for _ in prompts]
    gens: list[torch.Generator | None] = [None] * len(prompts)
    stop_set = set(stop)
    slots: list[int | None] = [None] * min(cfg.batch_size, len(prompts))  # prompt index of each row, None: free
    cache = RowCache(model, len(slots))
    logits = None  # [rows, V]: each occupied row's next-token logits
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False)
    while True:
        for r in range(len(slots)):
            if slots[r] is None and queue:
                i = slots[r] = queue.popleft()
                row_logits, h = prefill(model, prompts[i], cache, r, cfg.max_new_tokens, layers)
                if logits is None:
                    logits = row_logits.new_empty(len(slots), row_logits.shape[-1])
                logits[r] = row_logits
                for k in layers:
                    hidden[i][k].append(h[k])
                if cfg.temperature > 0:
                    gens[i] = torch.Generator(device=device).manual_seed(_seed(cfg, i))
        live = [r for r, i in enumerate(slots) if i is not None]
        if not live:
            break
        # once nothing is left to refill, free rows only cost compute: drop them when a quarter of the batch is idle
        if not queue and len(slots) - len(live) >= len(slots) / 4:
            cache.select(live)
            logits, slots = logits[live], [slots[r] for r in live]
            live = list(range(len(slots)))
        feed = [pad_id] * len(slots)
        finishing = []  # rows fed their last token only so that its hidden states are kept
        for r, t in zip(live, draw(logits[live], cfg, [gens[slots[r]] for r in live])):
            i = slots[r]
            tokens[i].append(t)
            done = t in stop_set or len(tokens[i]) == cfg.max_new_tokens
            if done:
                bar.update(1)
            if done and not layers:
                cache.free(r)
                slots[r] = None
            else:
                feed[r] = t
                if done:
                    finishing.append(r)
        fed = [r for r in live if slots[r] is not None]
        if not fed:
            continue  # every live row just finished: refill or stop
        positions, mask = cache.begin_step()
        out = model(input_ids=torch.tensor(feed, device=device)[:, None], attention_mask=mask, position_ids=positions,
                    cache=cache, use_cache=True, output_hidden_states=bool(layers))
        cache.end_step()
        logits = out.logits[:, -1]
        for r in fed:
            for k in layers:
                hidden[slots[r]][k].append(out.hidden_states[k][r])
        for r in finishing:
            cache.free(r)
            slots[r] = None
    bar.close()
    feats = [{k: torch.cat(h[k]) for k in layers} for h in hidden] if layers else None
    return tokens, feats


def prompt_ids(r: Record, tok) -> list[int]:
    if r.messages is not None:
        text = chat.render(tok, r.messages, add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids
    return tok(r.prompt).input_ids  # plain text: with the tokenizer's BOS, as the target was trained


def _answer_all(target: Target, pending: list[Record], cfg: DistillConfig, layers, split: str,
                engine=None) -> list[Record]:
    """Generated answers, turn by turn; single-turn records come back exact (prompt_ids + token_ids). ``engine``:
    another answerer with ``sample(prompts, cfg, stop, desc)`` (train/vllm_answers.py), in place of sample()."""
    tok, stop = target.tokenizer, stop_ids(target)
    turn = 0
    while True:
        todo = [r for r in pending if r.needs_answer]
        if not todo:
            return pending
        turn += 1
        prompts = [prompt_ids(r, tok) for r in todo]
        last = [not r.followups for r in todo]
        desc = f"{split} answers (turn {turn})"
        if engine is not None:
            outputs, feats = engine.sample(prompts, cfg, stop, desc), None
        else:
            outputs, feats = sample(target.model, prompts, cfg, stop, tok.pad_token_id, layers, desc=desc)
        for j, (r, p, new) in enumerate(zip(todo, prompts, outputs)):
            if last[j] and turn == 1:  # the exact tokens the target produced, and their features
                r.prompt_ids, r.token_ids, r.messages, r.prompt = p, new, None, None
                r.features = feats[j] if feats else None
            else:  # a later turn follows: keep the conversation as text and render it again
                answer = tok.decode(new[:-1] if new and new[-1] in stop else new, skip_special_tokens=True)
                r.messages.append({"role": "assistant", "content": answer})
                if r.followups:
                    r.messages.append({"role": "user", "content": r.followups.pop(0)})


def as_question(r: Record) -> Record:
    """The record with its assistant turns removed: the first user turn asked, the later ones queued as followups."""
    if r.messages is None or r.messages[-1]["role"] != "assistant":
        return r
    r = copy.deepcopy(r)
    turns = [m["content"] for m in r.messages if m["role"] == "user"]
    r.messages = [m for m in r.messages if m["role"] == "system"] + [{"role": "user", "content": turns[0]}]
    r.followups = turns[1:]
    return r


def answer(records: list[Record], target: Target, cfg: DistillConfig, force: bool = False, split: str = "train",
           layers=(), costs: list | None = None) -> list[Record]:
    """Records with every answer written by the target (cached). ``force``: regenerate existing answers too.
    ``costs``: gets what answering cost ({file, answers, wall_seconds, cpu_seconds}), measured now or read from the
    cache's ``.cost.json``, so that a run served from the cache still knows what its text cost (α per CPU-minute)."""
    todo = [as_question(r) if force else r for r in records]
    pending_idx = {i for i, r in enumerate(todo) if r.needs_answer}
    if not pending_idx:
        return todo
    copies = 1 if split != "train" else cfg.samples_per_prompt
    pending = [copy.deepcopy(todo[i]) for i in sorted(pending_idx) for _ in range(copies)]
    asked = [r.key() for r in pending]  # before answering: an answered record is its token ids, not its question
    key_src = json.dumps({"version": 2, "target": target.identity(), "cfg": cfg.__dict__, "copies": copies,
                          "prompts": [[r.messages, r.followups, r.prompt] for r in pending]}, sort_keys=True)
    path = cache_dir() / "data" / f"{target.name.replace('/', '_')}-{split}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}.jsonl"
    cost_file = path.with_suffix(".cost.json")
    if path.exists():
        log.info("self-distilled %s answers: reusing %s", split, path)
        answered = [Record(**json.loads(line), where=f"{path}:{n}") for n, line in enumerate(path.open(), 1)]
        cost = json.loads(cost_file.read_text()) if cost_file.exists() else {"file": path.name, "unknown": True}
    else:
        log.info("self-distillation: %s answers %d %s prompts (cached at %s)", target.name, len(pending), split, path)
        wall, cpu = time.perf_counter(), time.process_time()
        answered = _answer_all(target, pending, cfg, layers, split)
        cost = {"file": path.name, "answers": len(answered), "wall_seconds": round(time.perf_counter() - wall, 1),
                "cpu_seconds": round(time.process_time() - cpu, 3), "threads": torch.get_num_threads()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # ranks sharing a cache never share a temp file
        with tmp.open("w") as f:
            for r in answered:
                row = {"messages": r.messages} if r.messages is not None else \
                    {"prompt_ids": r.prompt_ids, "token_ids": r.token_ids}
                f.write(json.dumps(row) + "\n")
        tmp.replace(path)  # atomic: a killed run leaves no half-written cache
        cost_file.write_text(json.dumps(cost))
    if costs is not None:
        costs.append(cost)
    for r, src, key in zip(answered, pending, asked):  # the cache file keeps only the text
        r.category, r.split, r.asked_key = src.category, src.split, key
    return [r for i, r in enumerate(todo) if i not in pending_idx] + answered
