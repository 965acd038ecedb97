"""train.distill.sample (batched, left-padded, preallocated cache, rows dropped in bulk) gives every prompt exactly
the tokens and hidden states of a plain loop that runs each prompt alone through HF's own DynamicCache."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from heads.sampling import probs_from_logits
from train.distill import DistillConfig, sample

TEXTS = ["Once upon a time", "Tom had a big red ball and", "The cat", "Lily wanted to go to the park with her mom, but",
         "One day, a little bird", "Sam", "The sun was hot and the dog was thirsty. He", "Mia liked to draw",
         "There was a girl who"]


@torch.no_grad()
def reference(model, prompts, cfg: DistillConfig, stop, layers):
    """Each prompt alone (no padding, no batch); the live prompts of a batch draw together from one generator seeded
    as sample() seeds it, so seeded sampling is comparable draw for draw."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    tokens = [[] for _ in prompts]
    hidden = [{k: [] for k in layers} for _ in prompts]

    def step(i, ids, cache):
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, output_hidden_states=True)
        for k in layers:
            hidden[i][k].append(out.hidden_states[k][0])
        return out.logits[0, -1]

    for b0 in range(0, len(order), cfg.batch_size):
        rows = order[b0:b0 + cfg.batch_size]
        gen = torch.Generator().manual_seed(cfg.seed + b0)
        caches = {i: DynamicCache() for i in rows}
        logits = {i: step(i, prompts[i], caches[i]) for i in rows}
        live = list(rows)
        for n in range(cfg.max_new_tokens):
            probs = probs_from_logits(torch.stack([logits[i] for i in live]), cfg.temperature, 0, cfg.top_p)
            drawn = torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist()
            for i, t in zip(live, drawn):
                tokens[i].append(t)
                if layers or (t not in stop and n < cfg.max_new_tokens - 1):
                    logits[i] = step(i, [t], caches[i])
            live = [i for i, t in zip(live, drawn) if t not in stop and n < cfg.max_new_tokens - 1]
            if not live:
                break
    return tokens, [{k: torch.cat(h[k]) for k in layers} for h in hidden]


@pytest.mark.shared
@pytest.mark.parametrize("temperature,layers", [(0.0, ()), (0.8, (1, 5))])
def test_batched_sampling_matches_one_prompt_at_a_time(stories_target, temperature, layers):
    model, tok = stories_target.model, stories_target.tokenizer
    prompts = [tok(t).input_ids for t in TEXTS]
    # batches of 6 then 3: one finished row of 6 stays in the batch, later ones are dropped (a quarter rule)
    cfg = DistillConfig(max_new_tokens=24, temperature=temperature, top_p=0.9, batch_size=6, seed=3)
    free, _ = reference(model, prompts, cfg, [], ())
    stop = sorted({free[0][4], free[3][9], free[5][14]})  # tokens these answers reach: rows end at different steps

    want_tokens, want_hidden = reference(model, prompts, cfg, stop, layers)
    got_tokens, got_hidden = sample(model, prompts, cfg, stop, tok.pad_token_id, layers)

    lengths = [len(t) for t in want_tokens]
    assert len(set(lengths)) >= 3 and max(lengths) == cfg.max_new_tokens, lengths  # the test exercises row drops
    assert got_tokens == want_tokens
    if layers:
        for p, new, got, want in zip(prompts, got_tokens, got_hidden, want_hidden):
            for k in layers:
                assert got[k].shape == want[k].shape == (len(p) + len(new), model.config.hidden_size)
                torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=1e-4)
    else:
        assert got_hidden is None
