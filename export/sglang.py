"""SGLang draft directories: ``LlamaForCausalLMEagle`` (EAGLE-1) and ``LlamaForCausalLMEagle3``.

Checked against sglang 0.5.23's sources:
- srt/models/llama_eagle.py: ``fc = nn.Linear(2H, H)`` keeps PyTorch's default bias=True and the loader skips
  missing keys, so an absent fc.bias would stay randomly initialised: we write zeros. Layer 0 deletes its
  input_layernorm. embed_tokens and lm_head are set from the target (speculative/eagle_worker_v2.py
  ``set_embed_and_head``); tie_word_embeddings must be false or lm_head aliases embed_tokens.
- srt/models/llama_eagle3.py: "midlayer" -> "layers.0"; fc bias from config "bias" (false); d2t becomes
  ``hot_token_id`` = d2t + arange; t2d is skipped; the residual is always the un-normed hidden state (no
  norm_before_residual). The embedding comes from the target (``set_embed``); the lm_head is the draft's own
  because draft_vocab_size is set.
- Aux ids: read only from ``eagle_config.eagle_aux_hidden_state_layer_ids``
  (srt/model_executor/model_runner_components/spec_aux_hidden_state.py), then srt/models/llama.py
  ``set_eagle3_layers_to_capture`` adds 1 ("for the ith layer, it takes the output of the (i-1)th layer") and
  captures the *input* of those layers in layer order. So SGLang's ids are the output-of-layer convention: ours
  (HF hidden_states index = input of layer k) minus 1. Without eagle_config it captures inputs of
  (2, L//2, L-3) directly. No top-level ids are written: vLLM would read them in its own convention.
"""
from __future__ import annotations

import torch

from export import reference
from export.common import (ExportContext, Written, engine_aux, layer_spec, llama_config, reduced_vocab, rename,
                           vocab_maps)
from export.vllm import llama_required, spec

FAMILIES = ("eagle", "eagle3")


def sglang_ids(ctx: ExportContext) -> list[int]:
    return [k - 1 for k in engine_aux(ctx.head)[0]]


def write(ctx: ExportContext) -> Written:
    state, d = ctx.state(), ctx.dims
    if ctx.family == "eagle":
        tensors = {"fc.weight": state["fc.weight"], "fc.bias": torch.zeros(d.hidden_size, dtype=ctx.dtype),
                   **rename(state, "layers.0.", "layers.0.")}
        return Written(llama_config(d, ctx.dtype, architectures=["LlamaForCausalLMEagle"]), tensors)
    ids, fc = engine_aux(ctx.head)
    tensors = {"fc.weight": fc.to(ctx.dtype), **rename(state, "midlayer.", "midlayer."),
               "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    if reduced_vocab(ctx.head):
        tensors["d2t"] = vocab_maps(ctx.head)[0]
    config = llama_config(d, ctx.dtype, architectures=["LlamaForCausalLMEagle3"], bias=False,
                          draft_vocab_size=ctx.head.draft_vocab_size, target_hidden_size=d.hidden_size,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids],
                                        "use_aux_hidden_state": True})
    return Written(config, tensors)


def required(ctx: ExportContext) -> dict:
    base = llama_required(ctx)  # includes tie_word_embeddings: false (true aliases lm_head to embed_tokens here)
    if ctx.family == "eagle":
        return {"architectures": ["LlamaForCausalLMEagle"], **base}
    return {"architectures": ["LlamaForCausalLMEagle3"], **base, "draft_vocab_size": ctx.head.draft_vocab_size,
            "eagle_config.eagle_aux_hidden_state_layer_ids": sglang_ids(ctx)}


def expected(cfg: dict, family: str) -> dict:
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    if family == "eagle":
        return {"fc.weight": ((H, 2 * H), None), "fc.bias": ((H,), None),
                **spec(layer_spec("layers.0", cfg, H, input_norm=False))}
    Vd = cfg.get("draft_vocab_size") or V
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    out = {"fc.weight": ((H, (len(ids) if ids else 3) * cfg.get("target_hidden_size", H)), None),
           **spec(layer_spec("midlayer", cfg, 2 * H, input_norm=True, hidden_norm=True)),
           "norm.weight": ((H,), None), "lm_head.weight": ((Vd, H), None)}
    if cfg.get("bias", False):
        out["fc.bias"] = ((H,), None)
    if Vd != V:
        out["d2t"] = ((Vd,), torch.int64)
    return out


def reference_logits(cfg: dict, tensors: dict, family: str, target, feats, K: int):
    embed, lm_head = target.embed_tokens.weight.float(), target.lm_head.weight.float()
    L = target.dims.num_layers
    if family == "eagle":
        return reference.eagle1(tensors, cfg, embed, lm_head, feats, K, final=L)
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    capture = [k + 1 for k in ids] if ids else [2, L // 2, L - 3]  # layers whose input is captured
    mapped = {k.replace("midlayer", "layers.0"): v for k, v in tensors.items() if "t2d" not in k}
    return reference.eagle3(mapped, cfg, embed, sorted(set(capture)), False, feats, K, "layers.0")


def commands(ctx: ExportContext, out: str, target: str) -> dict:
    algo = "EAGLE" if ctx.family == "eagle" else "EAGLE3"
    return {"serve": f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algo} "
                     f"--speculative-draft-model-path {out} --speculative-num-steps {ctx.gamma} "
                     f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {ctx.gamma + 1}"}
