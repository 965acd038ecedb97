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


def rotary_inv_freq_4x(config: dict) -> torch.Tensor:
    """transformers 4.x's LlamaRotaryEmbedding for a default-rope config: ``rope_theta`` at the top level, else
    its default 10000 (``rope_parameters`` is a 5.x field a 4.x reader ignores)."""
    assert config.get("rope_scaling") is None, "4.x would read rope_scaling as another rope type"
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = config.get("rope_theta", 10000.0)
    return 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)


def test_written_target_config_reads_alike_in_transformers_4_and_5(tmp_path):
    """A target directory the project writes gives 4.x and 5.x readers the same rotary frequencies (SmolLM2's
    base is 100000; a 4.x reader of transformers 5's plain save_pretrained output silently uses 10000)."""
    import json

    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from heads.target import _tiny_random, write_portable_config

    model, _ = _tiny_random(rope_theta=100000.0)
    model.save_pretrained(tmp_path)
    read_5x = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path)).inv_freq
    raw = json.loads((tmp_path / "config.json").read_text())
    assert not torch.allclose(rotary_inv_freq_4x(raw), read_5x)  # the defect the portable config exists for
    write_portable_config(tmp_path)
    fixed = json.loads((tmp_path / "config.json").read_text())
    torch.testing.assert_close(rotary_inv_freq_4x(fixed), read_5x)
    torch.testing.assert_close(LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path)).inv_freq, read_5x)
    assert fixed["torch_dtype"] == fixed["dtype"] == "float32"


@pytest.mark.parametrize("path", ["/nonexistent", "./missing/model", "~/no/such/dir"])
def test_missing_target_directory_is_named(path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_target("stories260k", path=path)


@pytest.mark.shared
def test_corrupt_target_weights_are_named(tmp_path):
    from heads.target import shared_dir

    src = shared_dir() / "models" / "stories260K-hf"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(OSError, match="corrupt or truncated"):
        load_target("stories260k", path=str(tmp_path))
