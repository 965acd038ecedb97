"""Self-distillation: the target answers prompts itself, so the head trains on what it will draft for at serve time.

A draft head is judged on the target's *own* continuations (that is what speculative decoding verifies), so the
best training text is the target's samples, not someone else's reference answers (EAGLE-3, Medusa-2 and
HASS all regenerate their data for this reason). Answers are sampled in batches with a KV cache and cached under
``~/.cache/draftheads/data/<target>-<hash>.jsonl``, keyed by the target's identity, the prompts and the sampling
settings, so a second run (or another rank) reuses them.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from heads.sampling import probs_from_logits
from heads.target import Target, cache_dir
from train.records import Record

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
    gen = getattr(target.model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def sample(model, prompts: list[list[int]], cfg: DistillConfig, stop: list[int], pad_id: int, desc="sampling"):
    """Batched sampling with a KV cache; returns the new tokens per prompt (stop token included if reached)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths -> little left padding
    results: list[list[int]] = [[] for _ in prompts]
    stop_t = torch.tensor(stop, device=device)
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False)
    for b0 in range(0, len(order), cfg.batch_size):
        rows = order[b0:b0 + cfg.batch_size]
        gen = torch.Generator(device=device).manual_seed(cfg.seed + b0)
        T = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(rows), T), dtype=torch.long, device=device)
        for r, i in enumerate(rows):  # left padding: every row's next token lands in the same column
            ids[r, T - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, T - len(prompts[i]):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]  # the lm_head only where we sample
        alive = list(rows)  # prompt index of each live row
        for _ in range(cfg.max_new_tokens):
            probs = probs_from_logits(logits, cfg.temperature, 0, cfg.top_p)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # [B]
            for r, i in enumerate(alive):
                results[i].append(int(nxt[r]))
            keep = ~torch.isin(nxt, stop_t)
            if not keep.all():  # drop finished rows from the batch and the cache: no compute on dead rows
                bar.update(int((~keep).sum()))
                idx = keep.nonzero().squeeze(-1)
                alive = [alive[r] for r in idx.tolist()]
                if not alive:
                    break
                cache.batch_select_indices(idx)
                nxt, mask, positions = nxt[idx], mask[idx], positions[idx]
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=True).logits[:, -1]
        bar.update(len(alive) if alive else 0)
    bar.close()
    return results


def _answer_round(target: Target, pending: list[Record], cfg: DistillConfig, desc: str) -> None:
    """One generated answer for each pending record (in place)."""
    tok = target.tokenizer
    prompts = []
    for r in pending:
        if r.messages is not None:
            text = tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
            prompts.append(tok(text, add_special_tokens=False).input_ids)
        else:
            prompts.append(tok(r.prompt).input_ids)
    stop = stop_ids(target)
    outputs = sample(target.model, prompts, cfg, stop, tok.pad_token_id, desc)
    for r, p, new in zip(pending, prompts, outputs):
        new = new[:-1] if new and new[-1] in stop else new
        if r.messages is not None:
            r.messages.append({"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)})
            if r.followups:
                r.messages.append({"role": "user", "content": r.followups.pop(0)})
        else:  # decode the whole text: sentencepiece drops a continuation's leading space when decoded alone
            r.text, r.prompt = tok.decode(p + new, skip_special_tokens=True), None


def answer(records: list[Record], target: Target, cfg: DistillConfig, force: bool = False, split: str = "train"):
    """Records with every answer written by the target (cached). ``force``: regenerate existing answers too."""
    todo = []
    for r in records:
        if force and r.messages is not None and r.messages[-1]["role"] == "assistant":
            r = copy.deepcopy(r)
            turns = [m["content"] for m in r.messages if m["role"] == "user"]
            r.messages = [m for m in r.messages if m["role"] == "system"] + [{"role": "user", "content": turns[0]}]
            r.followups = turns[1:]
        todo.append(r)
    pending_idx = [i for i, r in enumerate(todo) if r.needs_answer]
    if not pending_idx:
        return todo
    copies = 1 if split != "train" else cfg.samples_per_prompt
    pending = [copy.deepcopy(todo[i]) for i in pending_idx for _ in range(copies)]
    key_src = json.dumps({"target": target.identity(), "cfg": cfg.__dict__, "copies": copies,
                          "prompts": [[r.messages, r.followups, r.prompt] for r in pending]}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    path = cache_dir() / "data" / f"{target.name.replace('/', '_')}-{split}-{key}.jsonl"
    if path.exists():
        log.info("self-distilled %s answers: reusing %s", split, path)
        answered = [Record(**json.loads(line), where=f"{path}:{n}") for n, line in enumerate(path.open(), 1)]
    else:
        log.info("self-distillation: %s answers %d %s prompts (cached at %s)", target.name, len(pending), split, path)
        rounds = 0
        while any(r.needs_answer for r in pending):
            rounds += 1
            todo_now = [r for r in pending if r.needs_answer]
            _answer_round(target, todo_now, cfg, desc=f"{split} answers (turn {rounds})")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for r in pending:
                f.write(json.dumps({"messages": r.messages} if r.messages is not None else {"text": r.text}) + "\n")
        tmp.rename(path)  # atomic: a killed run leaves no half-written cache
        answered = pending
    pending_set = set(pending_idx)
    return [r for i, r in enumerate(todo) if i not in pending_set] + answered
