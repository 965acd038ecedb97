"""The targets load as the real models they claim to be, and features follow HF's hidden-state convention."""
from __future__ import annotations

import pytest
import torch

from heads.target import load_target


@pytest.mark.shared
def test_stories260k_greedy_is_the_published_sample(stories_target):
    tok = stories_target.tokenizer
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = stories_target.model.generate(ids, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    ), text


def test_features_follow_hf_convention(tiny_target):
    ids = torch.randint(0, tiny_target.dims.vocab_size, (2, 12))
    L = tiny_target.dims.num_layers
    feats = tiny_target.features(ids, layers=(2, L // 2))
    ref = tiny_target.model(ids, output_hidden_states=True)
    torch.testing.assert_close(feats.target_logits, ref.logits.float())
    torch.testing.assert_close(feats.hidden[2], ref.hidden_states[2])
    # hidden[L] is the final-norm output: the lm_head applied to it gives the logits
    torch.testing.assert_close(tiny_target.lm_head(feats.hidden[L]), ref.logits)
    assert set(feats.hidden) == {2, L // 2, L}


@pytest.mark.slow
def test_smollm2_embedded_default_loads():
    target = load_target("smollm2-135m")
    ident = target.identity()
    assert (ident["hidden_size"], ident["vocab_size"], ident["num_layers"]) == (576, 49152, 30)
    tok = target.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = target.model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
