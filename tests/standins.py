"""Same-architecture stand-ins for the big targets: each one's published config.json, shrunk, with random weights.

What is kept from the real checkpoint: the model class, attention layout (MHA for Llama-2/Vicuna, 4:1 GQA for
Llama-3.1), rope (theta 1e4 / 5e5 and Llama-3.1's "llama3" frequency scaling), norm epsilon, context length,
untied lm_head, the release dtype, the tokenizer class and its special tokens, and the chat format. What is shrunk:
depth (8 layers, so EAGLE-3's default taps (2, L//2, L-3) are distinct, as SafeAILab's code needs), width (64,
heads 4, MLP ratio kept) and the vocabulary (the tokenizers below: 512 and 261 tokens instead of 32,000 and 128,256; a full-size embedding alone
would be most of the test's time and memory, and nothing in the path depends on the vocabulary's size).

Tokenizers are built here, from public facts: Llama-2 and Vicuna use a sentencepiece LlamaTokenizer with <s>=1,
</s>=2 (stories260K's, from ../shared, is exactly that at 512 tokens); Llama-3.1 uses a byte-level BPE
PreTrainedTokenizerFast with <|begin_of_text|>, <|eot_id|> and the header tokens, and ships its chat template.
"""
from __future__ import annotations

from pathlib import Path

import torch

from heads.chat import LLAMA3

# config.json of meta-llama/Llama-2-7b-chat-hf, lmsys/vicuna-7b-v1.3, meta-llama/Llama-3.1-8B-Instruct
ARCHITECTURES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                      vocab_size=32000, tie_word_embeddings=False, torch_dtype="float16"),
    "vicuna-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                      vocab_size=32000, tie_word_embeddings=False, torch_dtype="float16"),
    "llama3.1-8b-instruct": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256,
        tie_word_embeddings=False, torch_dtype="bfloat16",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
}
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def shrink(fields: dict, vocab_size: int, layers: int = 8, width: int = 64, heads: int = 4) -> dict:
    scale = width / fields["hidden_size"]
    out = dict(fields, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads, head_dim=width // heads,
               num_key_value_heads=heads * fields["num_key_value_heads"] // fields["num_attention_heads"],
               intermediate_size=round(fields["intermediate_size"] * scale), vocab_size=vocab_size)
    out.pop("torch_dtype")
    return out


def llama_sentencepiece(shared: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shared / "models" / "stories260K-hf")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2) and not tok.chat_template  # as Llama-2's
    return tok


def byte_level(bos: str, eos: str, specials: list[str], pad: str | None = None):
    """A byte-level BPE PreTrainedTokenizerFast with no merges (one token per byte) plus ``specials``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in specials:
        vocab.setdefault(s, len(vocab))
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=pad)
    tok.add_special_tokens({"additional_special_tokens": list(dict.fromkeys(specials))})
    return tok


def llama3_byte_level():
    tok = byte_level("<|begin_of_text|>", "<|eot_id|>", LLAMA3_SPECIALS)
    tok.chat_template = LLAMA3  # the real tokenizer ships its template (with a date preamble we leave out)
    return tok


def build_standin(name: str, out: Path, shared: Path, seed: int = 0) -> Path:
    """Write a shrunk, randomly initialised ``name`` (a conf/target name) as an HF directory; returns it."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    fields = ARCHITECTURES[name]
    tok = llama3_byte_level() if name.startswith("llama3") else llama_sentencepiece(shared)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    if name.startswith("llama3"):  # Llama-3.1-Instruct stops at <|end_of_text|> and <|eot_id|>
        ids["eos_token_id"] = [tok.convert_tokens_to_ids("<|end_of_text|>"), tok.eos_token_id]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shrink(fields, len(tok)), **ids))
    model.generation_config = GenerationConfig(**ids)
    model.to(getattr(torch, fields["torch_dtype"])).save_pretrained(out)
    tok.save_pretrained(out)
    return out
