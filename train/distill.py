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
from dataclasses import dataclass

import torch
from tqdm import tqdm

from heads import chat
from heads.sampling import probs_from_logits
from heads.target import Target, cache_dir
from train.kv_cache import slot_cache
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
    extra = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def sample(model, prompts: list[list[int]], cfg: DistillConfig, stop: list[int], pad_id: int, layers=(),
           desc: str = "sampling"):
    """Batched sampling with a KV cache.

    Returns (new tokens per prompt, the stop token included when reached; and when ``layers`` is non-empty, per
    prompt {k: [len(prompt) + len(new), H]} hidden states, i.e. HF ``hidden_states[k]`` of every token).
    """
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths -> little left padding
    tokens: list[list[int]] = [[] for _ in prompts]
    hidden: list[dict[int, list[torch.Tensor]]] = [{k: [] for k in layers} for _ in prompts]
    stop_t = torch.tensor(stop, device=device)
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False)
    for b0 in range(0, len(order), cfg.batch_size):
        rows = order[b0:b0 + cfg.batch_size]
        gen = torch.Generator(device=device).manual_seed(cfg.seed + b0)
        T = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long, device=device)
        # the 2-D mask for prompt + every answer slot, allocated once; each step passes its first columns
        mask = torch.ones((len(rows), T + cfg.max_new_tokens), dtype=torch.long, device=device)
        for r, i in enumerate(rows):  # left padding: every row's next token lands in the same column
            ids[r, T - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, :T - len(prompts[i])] = 0
        positions = (mask[:, :T].cumsum(-1) - 1).clamp_min(0)
        cache = slot_cache(model, T + cfg.max_new_tokens)
        out = model(input_ids=ids, attention_mask=mask[:, :T], position_ids=positions, cache=cache, use_cache=True,
                    output_hidden_states=bool(layers), logits_to_keep=1)  # the lm_head only where we sample
        for r, i in enumerate(rows):
            for k in layers:
                hidden[i][k].append(out.hidden_states[k][r, T - len(prompts[i]):])
        logits = out.logits[:, -1]  # [B, V]
        slots: list[int | None] = list(rows)  # prompt index of each batch row; None once it finished
        for step in range(cfg.max_new_tokens):
            live = [r for r, i in enumerate(slots) if i is not None]
            # finished rows stay in the batch until compacted, but draw nothing: the generator's stream (and so
            # every sampled token) is the one of a batch holding only the live rows
            probs = probs_from_logits(logits[live] if len(live) < len(slots) else logits, cfg.temperature, 0,
                                      cfg.top_p)
            drawn = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # [live]
            for r, t in zip(live, drawn.tolist()):
                tokens[slots[r]].append(t)
            done = torch.isin(drawn, stop_t) | (step == cfg.max_new_tokens - 1)
            nxt = torch.full((len(slots),), pad_id, dtype=torch.long, device=device)
            nxt[live] = drawn
            positions = positions[:, -1:] + 1
            if layers or not done.all():  # with layers, finished rows read their last token once more
                out = model(input_ids=nxt[:, None], attention_mask=mask[:, :T + step + 1], position_ids=positions,
                            cache=cache, use_cache=True, output_hidden_states=bool(layers))
                logits = out.logits[:, -1]
                for r in live:
                    for k in layers:
                        hidden[slots[r]][k].append(out.hidden_states[k][r])
            if done.any():
                bar.update(int(done.sum()))
                for r in (torch.tensor(live)[done]).tolist():
                    slots[r] = None
                keep = [r for r, i in enumerate(slots) if i is not None]
                if not keep:
                    break
                # dropping rows copies the whole cache: worth it once a quarter of the batch computes for nothing
                if len(slots) - len(keep) >= len(slots) / 4:
                    idx = torch.tensor(keep, device=device)
                    cache.batch_select_indices(idx)
                    mask, positions, logits = mask[idx], positions[idx], logits[idx]
                    slots = [slots[r] for r in keep]
    bar.close()
    feats = [{k: torch.cat(h[k]) for k in layers} for h in hidden] if layers else None
    return tokens, feats


def _prompt_ids(r: Record, tok) -> list[int]:
    if r.messages is not None:
        text = chat.render(tok, r.messages, add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids
    return tok(r.prompt).input_ids  # plain text: with the tokenizer's BOS, as the target was trained


def _answer_all(target: Target, pending: list[Record], cfg: DistillConfig, layers, split: str) -> list[Record]:
    """Generated answers, turn by turn; single-turn records come back exact (prompt_ids + token_ids)."""
    tok, stop = target.tokenizer, stop_ids(target)
    turn = 0
    while True:
        todo = [r for r in pending if r.needs_answer]
        if not todo:
            return pending
        turn += 1
        prompts = [_prompt_ids(r, tok) for r in todo]
        last = [not r.followups for r in todo]
        outputs, feats = sample(target.model, prompts, cfg, stop, tok.pad_token_id, layers,
                                desc=f"{split} answers (turn {turn})")
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
           layers=()) -> list[Record]:
    """Records with every answer written by the target (cached). ``force``: regenerate existing answers too."""
    todo = [as_question(r) if force else r for r in records]
    pending_idx = {i for i, r in enumerate(todo) if r.needs_answer}
    if not pending_idx:
        return todo
    copies = 1 if split != "train" else cfg.samples_per_prompt
    pending = [copy.deepcopy(todo[i]) for i in sorted(pending_idx) for _ in range(copies)]
    key_src = json.dumps({"version": 2, "target": target.identity(), "cfg": cfg.__dict__, "copies": copies,
                          "prompts": [[r.messages, r.followups, r.prompt] for r in pending]}, sort_keys=True)
    path = cache_dir() / "data" / f"{target.name.replace('/', '_')}-{split}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}.jsonl"
    if path.exists():
        log.info("self-distilled %s answers: reusing %s", split, path)
        answered = [Record(**json.loads(line), where=f"{path}:{n}") for n, line in enumerate(path.open(), 1)]
    else:
        log.info("self-distillation: %s answers %d %s prompts (cached at %s)", target.name, len(pending), split, path)
        answered = _answer_all(target, pending, cfg, layers, split)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # ranks sharing a cache never share a temp file
        with tmp.open("w") as f:
            for r in answered:
                row = {"messages": r.messages} if r.messages is not None else \
                    {"prompt_ids": r.prompt_ids, "token_ids": r.token_ids}
                f.write(json.dumps(row) + "\n")
        tmp.replace(path)  # atomic: a killed run leaves no half-written cache
    for r, src in zip(answered, pending):  # the cache file keeps only the text
        r.category = src.category
    return [r for i, r in enumerate(todo) if i not in pending_idx] + answered
