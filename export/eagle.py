"""SafeAILab's native EAGLE layout, as their reference code (``EaModel.from_pretrained(base_model_path=TARGET,
ea_model_path=OUT, use_eagle3=...)``) loads it.

Checked against SafeAILab/EAGLE's eagle/model/ea_model.py, cnets1.py (EAGLE-1) and cnets.py (EAGLE-3):
- ea_model.py reads config.json with EConfig (a LlamaConfig), ``bias`` from it (default **true**: fc gets a bias),
  then pytorch_model.bin or, failing that, model.safetensors, loaded with ``strict=False`` (so every name must be
  right: a wrong one is silently left at its initialisation); for EAGLE-3, d2t/t2d are deleted when vocab_size ==
  draft_vocab_size.
- the draft's token embedding: cnets1.py always reads the base model's ``model.embed_tokens.weight`` (through the
  target's ``model.safetensors.index.json``); cnets.py does so only when config.json has **no**
  ``target_hidden_size`` key (``hasattr`` on the config), and otherwise expects ``embed_tokens.weight`` in the draft's
  own file. So the EAGLE-3 config leaves ``target_hidden_size`` out (fc's width then comes from hidden_size, the
  same here: our heads share the target's width) and the embedding is not written: the client takes the target's.
  ``client_embedding`` applies that rule to the written files, so validation uses the embedding the client ends up
  with, and refuses an export where it would stay random.
- cnets1.py ``Model``: fc = Linear(2H, H, bias=bias) over cat(embed, hidden); layers.0 without input_layernorm;
  the base model's final-norm hidden state in, its lm_head out. Attention sizes come from
  ``head_dim = hidden_size // num_attention_heads`` (config head_dim is ignored) and reads ``rope_scaling``,
  ``rope_theta`` and ``pretraining_tp``.
- cnets.py (EAGLE-3): midlayer.{input_layernorm, hidden_norm, self_attn (2H in), post_attention_layernorm, mlp},
  fc [H, 3 * target_hidden_size], norm, lm_head [draft_vocab_size, H], d2t, t2d; the residual is the un-normed
  hidden state. The aux layers are not configurable: modeling_llama_kv.py captures the input of layers 2, L//2 and
  L-3 in layer order, so only heads that read exactly those three layers can go here.
"""
from __future__ import annotations

import torch

from export import reference, vllm
from export.common import ExportContext, ExportRefused, Written, engine_aux, llama_config, reduced_vocab, vocab_maps
from heads.layouts import safeailab_aux  # the layout's rules, shared with the importer (init_from=DIR)

FAMILIES = ("eagle", "eagle3")


def refuse_unsupported(ctx: ExportContext) -> None:
    d = ctx.dims
    if d.head_dim * d.num_heads != d.hidden_size:
        raise ExportRefused(f"SafeAILab's EAGLE code derives head_dim = hidden_size // num_heads, but this target has "
                            f"head_dim {d.head_dim} x {d.num_heads} heads != {d.hidden_size}; use format=vllm")
    if ctx.family == "eagle3":
        ids, L = engine_aux(ctx.head)[0], d.num_layers
        if len(safeailab_aux(L)) != 3:
            raise ExportRefused(f"SafeAILab's EAGLE-3 code captures layers (2, L//2, L-3) = {[2, L // 2, L - 3]} "
                                f"of this {L}-layer target, which repeat, so it cannot run on it; use format=vllm, "
                                "sglang, speculators or llamacpp")
        if ids != safeailab_aux(L):
            raise ExportRefused(f"SafeAILab's EAGLE-3 code always reads layers (2, L//2, L-3) = {[2, L // 2, L - 3]}; "
                                f"this head reads {list(ctx.head.aux_layers)}; use format=vllm, sglang, speculators "
                                "or llamacpp, which carry the layer ids")


def config(ctx: ExportContext) -> dict:
    extra = {"bias": False, "rope_scaling": None, "pretraining_tp": 1}
    if ctx.family == "eagle3":
        # no target_hidden_size: its presence makes cnets.py skip loading the target's embedding (see above)
        extra.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=ctx.head.draft_vocab_size)
    return llama_config(ctx.dims, ctx.dtype, **extra)


def write(ctx: ExportContext) -> Written:
    refuse_unsupported(ctx)
    written = vllm.write(ctx)  # same tensor names as vLLM's EAGLE-1 / EAGLE-3 (SafeAILab's checkpoints are the origin)
    written.config = config(ctx)
    if ctx.family == "eagle3" and reduced_vocab(ctx.head):
        written.tensors["t2d"] = vocab_maps(ctx.head)[1]
    return written


def required(ctx: ExportContext) -> dict:
    req = {k: v for k, v in vllm.llama_required(ctx).items() if k != "head_dim"}
    req.update({"bias": False, "rope_scaling": None, "pretraining_tp": 1, "rope_theta": ctx.dims.rope_theta})
    if ctx.family == "eagle3":
        req.update({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": ctx.head.draft_vocab_size})
    return req


def expected(cfg: dict, family: str) -> dict:
    cfg = {**cfg, "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]}  # what cnets computes
    out = vllm.expected(cfg, family)
    H = cfg["hidden_size"]
    if family == "eagle" and cfg.get("bias", True):
        out["fc.bias"] = ((H,), None)
    if family == "eagle3":
        out["fc.weight"] = ((H, 3 * cfg.get("target_hidden_size", H)), None)
        if "target_hidden_size" in cfg:  # cnets.py then reads the embedding from this file, not the target
            out["embed_tokens.weight"] = ((cfg["vocab_size"], H), None)
        Vd, V = cfg.get("draft_vocab_size", cfg["vocab_size"]), cfg["vocab_size"]
        if Vd != V:
            out["t2d"] = ((V,), torch.bool)
    return out


def client_embedding(cfg: dict, tensors: dict, family: str, target) -> torch.Tensor:
    """The token embedding SafeAILab's loader gives the draft layer, by its rules (cnets1.py / cnets.py
    ``Model.__init__`` with EaModel's ``load_emb=True``, then ``load_state_dict(strict=False)``)."""
    if family == "eagle" or "target_hidden_size" not in cfg:
        return target.embed_tokens.weight
    if "embed_tokens.weight" in tensors:
        return tensors["embed_tokens.weight"]
    raise ValueError("config.json has target_hidden_size, so SafeAILab's cnets.py does not load the target's "
                     "embedding, and the file has no embed_tokens.weight: the draft layer would keep a random "
                     "token embedding (strict=False loading, no error)")


def reference_logits(cfg: dict, tensors: dict, family: str, target, feats, K: int):
    cfg = {**cfg, "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]}
    embed, lm_head = client_embedding(cfg, tensors, family, target).float(), target.lm_head.weight.float()
    L = target.dims.num_layers
    if family == "eagle":
        return reference.eagle1(tensors, cfg, embed, lm_head, feats, K, final=L)
    skip = ("t2d", "embed_tokens.weight")  # not layer weights (the embedding, if carried, came in above)
    mapped = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k not in skip}
    return reference.eagle3(mapped, cfg, embed, safeailab_aux(L), False, feats, K, "layers.0")


# What SafeAILab's code (transformers 4.53) needs of the target folder beyond what HF writes; export READMEs say it.
TARGET_FOLDER = ("model.safetensors.index.json beside the weights (cnets finds the embedding through it), a tokenizer "
                 "AutoTokenizer opens with use_fast=False (tokenizer.model or vocab.json + merges.txt, or "
                 "tokenizer_class PreTrainedTokenizerFast in tokenizer_config.json), no list-valued "
                 "extra_special_tokens, and rope_theta at the top level of config.json")


def commands(ctx: ExportContext, out: str, target: str) -> dict:
    return {"python": "from eagle.model.ea_model import EaModel\n"
                      f"model = EaModel.from_pretrained(base_model_path={target!r}, ea_model_path={out!r}, "
                      f"use_eagle3={ctx.family == 'eagle3'}, total_token=60, depth={ctx.gamma}, top_k=10)\n"
                      "# then model.eagenerate(input_ids, temperature=0.0, max_new_tokens=64)"}
