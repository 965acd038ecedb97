"""Fast tier: every (family, format) pair exports, validates, and its files map back to an identical head.

The round trip reads the written files with an inverse key map written here from the engines' loaders (not from
export/'s code), rebuilds a head from the registry with the aux ids the engine would capture, and requires the
same logits as the original: a renamed, transposed, dropped or mis-ordered tensor fails it.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from export import FORMATS
from heads import build_head
from heads.base import TargetDims

PAIRS = [(family, fmt) for fmt, module in FORMATS.items() for family in module.FAMILIES]


def rename(tensors, old, new):
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in tensors.items()}


def import_state(fmt, family, cfg, t, L):
    """Written files -> (native state dict, hparam overrides): the engines' reading, inverted."""
    if family == "eagle":
        if "fc.bias" in t:  # SGLang's fc has a bias; the export must make it a no-op
            assert torch.equal(t.pop("fc.bias"), torch.zeros_like(t["fc.weight"][:, 0]))
        return t, {}
    if family == "eagle3":
        t = rename(t, "layers.0.", "midlayer.")  # speculators' name; vLLM/SGLang/llama.cpp/SafeAILab use midlayer
        V, Vd = cfg.get("vocab_size") or cfg["transformer_layer_config"]["vocab_size"], t["lm_head.weight"].shape[0]
        d2t = t.get("d2t", torch.zeros(Vd, dtype=torch.long))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[d2t + torch.arange(Vd)] = True
        if "t2d" in t:
            assert torch.equal(t["t2d"], t2d)
        t.update(d2t=d2t, t2d=t2d)
        if fmt == "sglang":
            ids = [k + 1 for k in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]  # output-of-layer ids
        elif fmt == "eagle":
            ids = sorted({2, L // 2, L - 3})
        else:
            ids = cfg["eagle_aux_hidden_state_layer_ids"]
        return t, {"aux_layers": ids, "draft_vocab_size": Vd}
    if family == "medusa" and fmt == "medusa":
        K = cfg["medusa_num_heads"]
        state = {}
        for h in range(K):
            state[f"blocks.{h}.layers.0.weight"] = t[f"{h}.0.linear.weight"]
            state[f"blocks.{h}.layers.0.bias"] = t[f"{h}.0.linear.bias"]
            state[f"lm_heads.{h}.weight"] = t[f"{h}.1.weight"]
        return state, {"num_steps": K, "num_layers": 1, "bias": True}
    if family == "medusa":
        return t, {"num_steps": cfg["num_heads"], "num_layers": cfg["num_hidden_layers"], "bias": cfg["medusa_fc_bias"]}
    state, K = {}, cfg["num_nextn_predict_layers"]  # mtp
    for i in range(K):
        p = f"model.layers.{L + i}."
        for k, v in t.items():
            if not k.startswith(p):
                continue
            name = k[len(p):]
            if name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
                state[f"layers.{i}.{name}"] = v
            elif name == "shared_head.norm.weight":
                state["norm.weight"] = v
            elif name not in ("embed_tokens.weight", "shared_head.head.weight"):
                state[f"layers.{i}.layer.{name}"] = v
    return state, {"num_steps": K}


def read(out, fmt):
    weights = "medusa_lm_head.safetensors" if fmt == "medusa" else "model.safetensors"
    return json.loads((out / "config.json").read_text()), load_file(str(out / weights))


def logits(head, feats, K):
    return [head.to_target_vocab(x) for x in head(feats, num_steps=K).logits]


@pytest.mark.parametrize("family,fmt", PAIRS)
def test_export_round_trips(family, fmt, tiny_target, head_dir, pair_hparams, run_export, tmp_path):
    head_path, head = head_dir(tiny_target, family, **pair_hparams(family, fmt, tiny_target))
    out = run_export(head_path, fmt, tmp_path / fmt)
    cfg, tensors = read(out, fmt)
    state, overrides = import_state(fmt, family, cfg, dict(tensors), tiny_target.dims.num_layers)
    rebuilt = build_head(family, tiny_target.dims, **{**head.hparams(), **overrides})
    rebuilt.load_state_dict(state, strict=True)
    rebuilt.attach_target(tiny_target)
    ids = torch.randint(0, tiny_target.dims.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    feats = tiny_target.features(ids, layers=range(tiny_target.dims.num_layers + 1))
    K = rebuilt.num_steps
    with torch.no_grad():
        for a, b in zip(logits(head, feats, K), logits(rebuilt, feats, K)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    meta = json.loads((out / "draftheads_export.json").read_text())
    assert meta["format"] == fmt and meta["family"] == family
    assert meta["target"]["tokenizer_sha256"] == tiny_target.identity()["tokenizer_sha256"]
    assert max(meta["validation"]["max_abs_logit_diff"]) < 1e-4
    assert f"format={fmt}" in (out / "README.md").read_text()
    assert not (tmp_path / f"{fmt}.tmp").exists()


def test_eagle3_aux_ids_follow_each_engines_convention(tiny_target, head_dir, run_export, tmp_path):
    """Head reads hidden_states (input of layer k) [5, 2, 5]: folded to three distinct ascending ids."""
    head_path, _ = head_dir(tiny_target, "eagle3", aux_layers=[5, 2, 5], draft_vocab_size=100)
    ids = {fmt: read(run_export(head_path, fmt, tmp_path / fmt), fmt)[0] for fmt in ("vllm", "sglang", "speculators",
                                                                                       "llamacpp")}
    assert ids["vllm"]["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]  # 7: an unused layer with a zero fc block
    assert ids["llamacpp"]["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]
    assert ids["speculators"]["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]
    assert ids["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]  # SGLang adds 1
    assert "eagle_aux_hidden_state_layer_ids" not in ids["sglang"]  # vLLM would read it in its own convention
    assert ids["speculators"]["norm_before_residual"] is False  # vLLM's speculators reader defaults it to true
    assert ids["vllm"]["norm_before_residual"] is False


def test_vocab_maps_only_where_the_engine_builds_them(tiny_target, head_dir, run_export, tmp_path):
    full, _ = head_dir(tiny_target, "eagle3", name="full", draft_vocab_size=10**6)  # clipped to the target vocab
    reduced, head = head_dir(tiny_target, "eagle3", name="reduced", draft_vocab_size=64)
    assert "d2t" not in read(run_export(full, "vllm", tmp_path / "full"), "vllm")[1]  # vLLM 0.32 has no param then
    _, t = read(run_export(reduced, "vllm", tmp_path / "vllm"), "vllm")
    assert t["d2t"].dtype == torch.int64 and "t2d" not in t  # vLLM skips t2d
    _, t = read(run_export(reduced, "speculators", tmp_path / "spec"), "speculators")
    assert torch.equal(t["t2d"].nonzero().flatten(), t["d2t"] + torch.arange(64))
    assert torch.equal(t["d2t"] + torch.arange(64), head.draft_to_target)


def test_bfloat16_export(tiny_target, head_dir, run_export, tmp_path):
    head_path, _ = head_dir(tiny_target, "eagle3", draft_vocab_size=64)
    cfg, t = read(run_export(head_path, "vllm", tmp_path / "bf16", dtype="bfloat16"), "vllm")
    assert cfg["torch_dtype"] == "bfloat16"
    assert {v.dtype for k, v in t.items() if k != "d2t"} == {torch.bfloat16} and t["d2t"].dtype == torch.int64


@pytest.mark.parametrize("source", ["config", "bench"])
def test_measured_settings_travel_with_the_export(tiny_target, head_dir, run_export, tmp_path, source):
    head_path, _ = head_dir(tiny_target, "medusa", num_steps=4)
    if source == "config":  # a `recommended` block in the head's config.json
        config = json.loads((head_path / "config.json").read_text())
        config["recommended"] = {"num_speculative_tokens": 2, "tree": "static", "tree_paths": [[0], [0, 0]]}
        (head_path / "config.json").write_text(json.dumps(config))
    else:  # serve/'s bench.json (serve/main.py's schema) beside DIR/head
        (head_path.parent / "bench.json").write_text(json.dumps(
            {"tau_measured": 1.8, "tokens_per_s": 50.0, "settings": {"gamma": 2, "temperature": 0.0}}))
    (head_path.parent / "acceptance.json").write_text(json.dumps(  # train/acceptance.py's schema
        {"temperature": 0.0, "alpha": [0.61, 0.4, 0.3, 0.2], "tau_predicted": 2.1, "num_tokens": 900}))
    out = run_export(head_path, "vllm", tmp_path / "vllm")
    cfg, t = read(out, "vllm")
    assert cfg["num_heads"] == 2 and "lm_heads.2.weight" not in t  # vLLM drafts with every head it loads
    meta = json.loads((out / "draftheads_export.json").read_text())
    assert meta["num_speculative_tokens"] == 2 and meta["acceptance"]["tau_predicted"] == 2.1
    assert meta["recommended"].get("tree_paths" if source == "config" else "tau_measured") in ([[0], [0, 0]], 1.8)
    readme = (out / "README.md").read_text()
    assert "'num_speculative_tokens': 2" in readme and "tau_predicted: 2.1" in readme


def test_medusa_with_independent_layers_goes_to_vllm_only(tiny_target, head_dir, run_export, tmp_path):
    from export import ExportRefused

    head_path, _ = head_dir(tiny_target, "medusa", num_layers=2, bias=False)
    cfg, t = read(run_export(head_path, "vllm", tmp_path / "vllm"), "vllm")
    assert cfg["medusa_fc_bias"] is False and "blocks.0.layers.1.weight" in t and "blocks.0.layers.0.bias" not in t
    with pytest.raises(ExportRefused, match="ties the 2 ResBlocks"):
        run_export(head_path, "medusa", tmp_path / "medusa")
    assert not (tmp_path / "medusa").exists() and not (tmp_path / "medusa.tmp").exists()


def test_rebuilt_dims_come_from_the_config(tiny_target, head_dir, run_export, tmp_path):
    """The vLLM EAGLE-1 config alone rebuilds the draft's dimensions (what the engine sizes its layer from)."""
    head_path, head = head_dir(tiny_target, "eagle")
    cfg, _ = read(run_export(head_path, "vllm", tmp_path / "vllm"), "vllm")
    dims = TargetDims(cfg["hidden_size"], cfg["vocab_size"], tiny_target.dims.num_layers, cfg["num_attention_heads"],
                      cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["rms_norm_eps"],
                      cfg["rope_parameters"]["rope_theta"], cfg["max_position_embeddings"])
    assert dims == head.dims and cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
