"""MTP modules in DeepSeek-V3's key layout: module k (1-based) is ``model.layers.{L + k - 1}`` of a target with L
layers, holding enorm, hnorm, eh_proj, embed_tokens, shared_head.norm, shared_head.head and an ordinary decoder
layer (self_attn.*, mlp.*, input_layernorm, post_attention_layernorm), as DeepSeek-V3's checkpoint stores its
layer 61 and vLLM's deepseek_mtp.py reads it. config.json is the target's Llama config plus
``num_nextn_predict_layers``.

No engine serves MTP modules for a Llama target: vLLM's and SGLang's MTP proposers are built into specific
target architectures (DeepSeek-V3, Qwen3-Next, GLM, MiMo...) and load these layers from the target's own
checkpoint. This layout documents the head in the form those loaders use; draftheads' own serve/ is the runner
that decodes with it. Our MTP shares one final norm across modules, which becomes each module's
shared_head.norm; embed_tokens and shared_head.head are copies of the target's (DeepSeek stores them per module).
"""
from __future__ import annotations

from export import reference
from export.common import ExportContext, Written, cast, layer_spec, llama_config
from export.vllm import spec

FAMILIES = ("mtp",)


def write(ctx: ExportContext) -> Written:
    state, d, L, target = ctx.state(), ctx.dims, ctx.dims.num_layers, ctx.target
    embed, head = cast(target.embed_tokens.weight, ctx.dtype), cast(target.lm_head.weight, ctx.dtype)
    tensors = {}
    for i in range(ctx.head.num_steps):
        p, src = f"model.layers.{L + i}", f"layers.{i}"
        tensors.update({
            f"{p}.enorm.weight": state[f"{src}.enorm.weight"], f"{p}.hnorm.weight": state[f"{src}.hnorm.weight"],
            f"{p}.eh_proj.weight": state[f"{src}.eh_proj.weight"], f"{p}.embed_tokens.weight": embed.clone(),
            f"{p}.shared_head.norm.weight": state["norm.weight"].clone(), f"{p}.shared_head.head.weight": head.clone(),
        })
        tensors.update({f"{p}.{k[len(src) + 7:]}": v for k, v in state.items() if k.startswith(f"{src}.layer.")})
    config = llama_config(d, ctx.dtype, num_layers=L, num_nextn_predict_layers=ctx.head.num_steps,
                          architectures=["DraftheadsMtpForLlama"])
    return Written(config, tensors)


def required(ctx: ExportContext) -> dict:
    d = ctx.dims
    return {"num_hidden_layers": d.num_layers, "num_nextn_predict_layers": ctx.head.num_steps,
            "hidden_size": d.hidden_size, "vocab_size": d.vocab_size, "num_attention_heads": d.num_heads,
            "num_key_value_heads": d.num_kv_heads, "head_dim": d.head_dim, "rms_norm_eps": d.rms_norm_eps,
            "rope_parameters.rope_theta": d.rope_theta, "intermediate_size": d.intermediate_size}


def expected(cfg: dict, family: str) -> dict:
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out = {}
    for i in range(cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{L + i}"
        out.update(spec({f"{p}.enorm.weight": (H,), f"{p}.hnorm.weight": (H,), f"{p}.eh_proj.weight": (H, 2 * H),
                         f"{p}.embed_tokens.weight": (V, H), f"{p}.shared_head.norm.weight": (H,),
                         f"{p}.shared_head.head.weight": (V, H)}))
        out.update(spec(layer_spec(p, cfg, H, input_norm=True)))
    return out


def reference_logits(cfg: dict, tensors: dict, family: str, target, feats, K: int):
    return reference.mtp(tensors, cfg, feats, K)


def commands(ctx: ExportContext, out: str, target: str) -> dict:
    return {"serve": "no engine serves MTP modules for a Llama target; decode with draftheads' serve/ "
                     "from the native head directory"}
