"""train.distill.sample (continuous batching: ragged rows, refilled as answers end, dropped in bulk at the end)
gives every prompt exactly the tokens and hidden states of a plain loop that runs each prompt alone through HF's own
DynamicCache."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from heads.sampling import probs_from_logits
from train.distill import DistillConfig, _seed, sample

TEXTS = ["Once upon a time", "Tom had a big red ball and", "The cat", "Lily wanted to go to the park with her mom, but",
         "One day, a little bird", "Sam", "The sun was hot and the dog was thirsty. He", "Mia liked to draw",
         "There was a girl who"]


@torch.no_grad()
def reference(model, prompts, cfg: DistillConfig, stop, layers):
    """Each prompt alone through HF's DynamicCache (no padding, no batch), drawing from its own seeded generator."""
    tokens = [[] for _ in prompts]
    hidden = [{k: [] for k in layers} for _ in prompts]
    for i, p in enumerate(prompts):
        gen = torch.Generator().manual_seed(_seed(cfg, i))
        cache = DynamicCache()
        ids = p
        while True:
            out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, output_hidden_states=True)
            for k in layers:
                hidden[i][k].append(out.hidden_states[k][0])
            if tokens[i] and (tokens[i][-1] in stop or len(tokens[i]) == cfg.max_new_tokens):
                break  # the last token was read only for its hidden states
            probs = probs_from_logits(out.logits[0, -1], cfg.temperature, 0, cfg.top_p)
            tokens[i].append(int(torch.multinomial(probs, 1, generator=gen)))
            ids = tokens[i][-1:]
            if not layers and (tokens[i][-1] in stop or len(tokens[i]) == cfg.max_new_tokens):
                break
    return tokens, [{k: torch.cat(h[k]) for k in layers} for h in hidden]


@pytest.mark.shared
@pytest.mark.parametrize("temperature,layers,batch_size", [(0.0, (), 3), (0.0, (), 16), (0.8, (1, 5), 4)])
def test_batched_sampling_matches_one_prompt_at_a_time(stories_target, temperature, layers, batch_size):
    model, tok = stories_target.model, stories_target.tokenizer
    prompts = [tok(t).input_ids for t in TEXTS]
    # batch 3 or 4 of 9 prompts: rows that finish early take the next prompt while the others are mid-answer;
    # batch 16: all prompts at once, finished rows dropped in bulk (the quarter rule)
    cfg = DistillConfig(max_new_tokens=24, temperature=temperature, top_p=0.9, batch_size=batch_size, seed=3)
    free, _ = reference(model, prompts, cfg, [], ())
    stop = sorted({free[0][4], free[3][9], free[5][14]})  # tokens these answers reach: rows end at different steps

    want_tokens, want_hidden = reference(model, prompts, cfg, stop, layers)
    got_tokens, got_hidden = sample(model, prompts, cfg, stop, tok.pad_token_id, layers)

    lengths = [len(t) for t in want_tokens]
    assert len(set(lengths)) >= 3 and max(lengths) == cfg.max_new_tokens, lengths  # rows end at different steps
    assert min(lengths) < cfg.max_new_tokens // 2, lengths  # so refilled rows start while others are mid-answer
    assert got_tokens == want_tokens
    if layers:
        for p, new, got, want in zip(prompts, got_tokens, got_hidden, want_hidden):
            for k in layers:
                assert got[k].shape == want[k].shape == (len(p) + len(new), model.config.hidden_size)
                torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=1e-4)
    else:
        assert got_hidden is None
