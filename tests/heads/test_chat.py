"""heads/chat.py: each chat format renders as its authors wrote it, and the loss mask trains exactly the answers.

Golden tests: a character-level tokenizer (one token per byte, plus each format's special tokens) makes the
expected trained / untrained text readable, and every expectation is written out by hand.
"""
from __future__ import annotations

import pytest
from heads.chat import CHAT_FORMATS, VICUNA_SYSTEM, MissingChatTemplate, apply_chat_format, render
from tests.standins import byte_level
from train.data import chat_example

CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "Four times three is twelve."},
]
SYSTEM = [{"role": "system", "content": "Be brief."}]

SPECIALS = {  # format -> (bos, eos, other special tokens)
    "chatml": ("<|im_start|>", "<|im_end|>", []),
    "llama-2": ("<s>", "</s>", []),
    "vicuna-v1.1": ("<s>", "</s>", []),
    "llama-3": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
}


def char_tokenizer(fmt: str | None):
    bos, eos, extra = SPECIALS[fmt or "chatml"]
    tok = byte_level(bos, eos, [bos, eos, *extra], pad=eos)
    apply_chat_format(tok, fmt)
    return tok


def split_by_mask(messages, tok):
    """(full text, trained text, untrained text): loss_mask[t] trains token t+1; token 0 is never trained."""
    ex = chat_example(messages, tok, max_len=4096)
    ids, trained = ex.input_ids.tolist(), [False] + ex.loss_mask[:-1].tolist()
    assert not ex.loss_mask[-1]
    pick = lambda want: tok.decode([i for i, t in zip(ids, trained) if t == want])  # noqa: E731
    return tok.decode(ids), pick(True), pick(False)


GOLDEN = {
    "llama-2": (
        SYSTEM + CONVERSATION,
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is two plus two? [/INST] Two plus two is four. </s>"
        "<s>[INST] And times three? [/INST] Four times three is twelve. </s>",
        " Two plus two is four. </s> Four times three is twelve. </s>",
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is two plus two? [/INST]<s>[INST] And times three? [/INST]",
    ),
    "vicuna-v1.1": (
        CONVERSATION,
        f"<s>{VICUNA_SYSTEM} USER: What is two plus two? ASSISTANT: Two plus two is four.</s>"
        "USER: And times three? ASSISTANT: Four times three is twelve.</s>",
        " Two plus two is four.</s> Four times three is twelve.</s>",
        f"<s>{VICUNA_SYSTEM} USER: What is two plus two? ASSISTANT:USER: And times three? ASSISTANT:",
    ),
    "llama-3": (
        SYSTEM + CONVERSATION,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nTwo plus two is four.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd times three?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFour times three is twelve.<|eot_id|>",
        "Two plus two is four.<|eot_id|>Four times three is twelve.<|eot_id|>",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd times three?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "chatml": (
        CONVERSATION,
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nTwo plus two is four.<|im_end|>\n"
        "<|im_start|>user\nAnd times three?<|im_end|>\n<|im_start|>assistant\nFour times three is twelve.<|im_end|>\n",
        "Two plus two is four.<|im_end|>\nFour times three is twelve.<|im_end|>\n",
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
        "<|im_start|>user\nAnd times three?<|im_end|>\n<|im_start|>assistant\n",
    ),
}


@pytest.mark.parametrize("fmt", sorted(GOLDEN))
def test_loss_mask_golden(fmt):
    messages, full, trained, untrained = GOLDEN[fmt]
    assert split_by_mask(messages, char_tokenizer(fmt)) == (full, trained, untrained)


@pytest.mark.parametrize("fmt", sorted(GOLDEN))
def test_generation_prompt_ends_where_the_answer_starts(fmt):
    """Self-distillation and serve/ prompt with the generation prompt: it must be the text before the answer."""
    tok = char_tokenizer(fmt)
    prompt = render(tok, CONVERSATION[:1], add_generation_prompt=True)
    assert render(tok, CONVERSATION[:2]).startswith(prompt)
    assert render(tok, CONVERSATION[:2])[len(prompt):].strip().startswith("Two plus two is four.")


def test_every_format_has_a_golden_test():
    assert set(GOLDEN) == set(CHAT_FORMATS)


def test_no_template_is_refused_with_the_fix():
    tok = char_tokenizer(None)
    tok.chat_template = None
    with pytest.raises(MissingChatTemplate, match=r"target\.chat_format= one of chatml, llama-2"):
        render(tok, CONVERSATION)
    with pytest.raises(ValueError, match="choose one of"):
        apply_chat_format(tok, "alpaca")
