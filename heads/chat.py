"""Chat formats as data: one Jinja template per format, chosen per target in conf/target/*.yaml (``chat_format``).

A draft head must see prompts framed exactly as the target was fine-tuned to read them, or its features come from
text the target never sees when serving. Targets whose tokenizer ships a template (Llama-3.x-Instruct, SmolLM2)
use their own (``chat_format: null``); Llama-2-chat and Vicuna ship none, so the format their authors trained with
is named here (the FastChat ``llama-2`` and ``vicuna_v1.1`` conversations). train/ (loss masks, self-distillation)
and serve/ (prompts) both render through ``render``, so a missing template is refused the same way everywhere.

Every template renders conversation prefixes consistently (the rendering of turns 1..i, with the generation prompt,
is a prefix of the rendering of turns 1..i+1): train/data.py finds assistant tokens that way. BOS is written by the
template itself (``bos_token``), since rendered text is tokenised with ``add_special_tokens=False``.
"""
from __future__ import annotations

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Meta's Llama-2-chat format (FastChat "llama-2"): <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s>
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{% set content = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# FastChat "vicuna_v1.1" (Vicuna v1.1-v1.5): "{system} USER: {user} ASSISTANT: {answer}</s>USER: ..."
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
VICUNA_V11 = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = \"" + VICUNA_SYSTEM + "\" %}"
    "{% set turns = messages %}{% endif %}"
    "{{ bos_token + system + ' ' }}"
    "{% for message in turns %}"
    "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Llama-3 Instruct's header format, for a Llama-3 tokenizer saved without its template (the real one adds a
# date preamble to the system turn; with the tokenizer's own template, chat_format: null, that is what is used).
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CHAT_FORMATS = {"chatml": CHATML, "llama-2": LLAMA2_CHAT, "vicuna-v1.1": VICUNA_V11, "llama-3": LLAMA3}


class MissingChatTemplate(ValueError):
    """Chat data for a tokenizer with no template and no configured format."""


def apply_chat_format(tokenizer, chat_format: str | None) -> None:
    """Give ``tokenizer`` the named format's template; None keeps the tokenizer's own (possibly none)."""
    if chat_format is None:
        return
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format={chat_format!r}; choose one of {', '.join(CHAT_FORMATS)} (or null for the "
                         "tokenizer's own template)")
    tokenizer.chat_template = CHAT_FORMATS[chat_format]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the target reads it; refuses a tokenizer that has no template."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise MissingChatTemplate(
            f"the target's tokenizer ({name}) has no chat template; set target.chat_format= one of "
            f"{', '.join(CHAT_FORMATS)} (the format the target was fine-tuned with), or use plain-text data")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
