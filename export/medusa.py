"""FasterDecoding's Medusa layout, as ``MedusaModel.from_pretrained(OUT)`` in their medusa/model/medusa_model.py
loads it: config.json (MedusaConfig: medusa_num_heads, medusa_num_layers, base_model_name_or_path) and
medusa_lm_head.pt, a torch state dict of ``medusa_head`` (loaded with ``strict=False``, so names must be exact).

Checked against FasterDecoding/Medusa medusa/model/medusa_model.py:
- head h is ``nn.Sequential(*([ResBlock(H)] * medusa_num_layers), nn.Linear(H, V, bias=False))``: keys
  ``{h}.{l}.linear.weight|bias`` (ResBlock's Linear always has a bias) and ``{h}.{medusa_num_layers}.weight``.
  ``[ResBlock(H)] * n`` repeats *one* module, so every layer of a head shares weights: only heads with
  num_layers == 1 can go here (use format=vllm otherwise).
- it reads the base model's final-norm hidden state (outputs[0]) and applies x + SiLU(linear(x)).
- ``from_pretrained`` on such a directory (config.json without model_type, so ``AutoConfig`` fails into the
  MEDUSA-v0.1 branch) sets ``medusa_num_heads = 5`` whatever config.json says: it always builds 5 heads. A head
  with fewer would leave the rest random, more would be silently dropped, so only 5-head heads go here (the
  training default); ``expected`` builds the key set from those 5, not from the written config.
The same tensors are also written as medusa_lm_head.safetensors (what their training script, TGI and
TensorRT-LLM read), and config.json carries medusa_fc_bias: true so vLLM's Medusa loader, which remaps these old
names (vllm medusa.py ``_remap_old_checkpoint_key``), keeps the biases instead of dropping them.
"""
from __future__ import annotations

import io
from pathlib import Path

import torch
from safetensors.torch import load_file

from export import reference
from export.common import ExportContext, ExportRefused, Written
from heads.layouts import medusa_key_map  # shared with the importer (init_from=DIR)

FAMILIES = ("medusa",)
CLIENT_HEADS = 5  # medusa_model.py, MedusaModelABC.from_pretrained: base_model_config.medusa_num_heads = 5
WEIGHTS = "medusa_lm_head.safetensors"
PICKLE = "medusa_lm_head.pt"


def write(ctx: ExportContext) -> Written:
    head, state = ctx.head, ctx.state()
    if head.num_layers != 1:
        raise ExportRefused(f"FasterDecoding's Medusa ties the {head.num_layers} ResBlocks of a head ([ResBlock] * n); "
                            "this head's are independent; use format=vllm")
    H, K = ctx.dims.hidden_size, head.num_steps
    if K != CLIENT_HEADS:
        fate = "leave the rest random" if K < CLIENT_HEADS else "drop the rest"
        raise ExportRefused(f"FasterDecoding's MedusaModel.from_pretrained always builds {CLIENT_HEADS} heads; this "
                            f"head has {K}, so the client would {fate}; train with "
                            f"head.hparams.num_steps={CLIENT_HEADS} (the default) or use format=vllm")
    # ResBlock's Linear always has a bias: a bias-free head's is zero (one tensor each: safetensors refuses shared ones)
    tensors = {theirs: state[native] if native in state else torch.zeros(H, dtype=ctx.dtype)
               for native, theirs in medusa_key_map(K, 1).items()}
    config = {"medusa_num_heads": K, "medusa_num_layers": 1, "base_model_name_or_path": ctx.target_path,
              "hidden_size": H, "vocab_size": ctx.dims.vocab_size, "medusa_fc_bias": True,
              "torch_dtype": str(ctx.dtype).removeprefix("torch.")}
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return Written(config, tensors, weights_file=WEIGHTS, extra={PICKLE: buffer.getvalue()})


def required(ctx: ExportContext) -> dict:
    return {"medusa_num_heads": ctx.head.num_steps, "medusa_num_layers": 1, "base_model_name_or_path": ctx.target_path}


def expected(cfg: dict, family: str) -> dict:
    """The client's parameter set: CLIENT_HEADS heads, whatever config.json says (see above)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    shape = {"weight": (H, H), "bias": (H,)}
    return {theirs: ((V, H) if native.startswith("lm_heads.") else shape[native.rsplit(".", 1)[1]], None)
            for native, theirs in medusa_key_map(CLIENT_HEADS, cfg["medusa_num_layers"]).items()}


def reference_logits(cfg: dict, tensors: dict, family: str, target, feats, K: int):
    n = cfg["medusa_num_layers"]
    blocks = [[(tensors[f"{h}.0.linear.weight"], tensors[f"{h}.0.linear.bias"])] * n for h in range(K)]  # tied
    return reference.medusa(blocks, [tensors[f"{h}.{n}.weight"] for h in range(K)], feats, target.dims.num_layers, K)


def check_pickle(out_dir) -> None:
    """medusa_lm_head.pt holds exactly the safetensors' tensors (the reference code reads the pickle)."""
    pickled = torch.load(Path(out_dir) / PICKLE, map_location="cpu", weights_only=True)
    stored = load_file(str(Path(out_dir) / WEIGHTS))
    if set(pickled) != set(stored) or any(not torch.equal(pickled[k], stored[k]) for k in stored):
        raise ValueError(f"{PICKLE} and {WEIGHTS} differ")


# What FasterDecoding's code (transformers 4.34) needs of the target folder; export READMEs say it.
TARGET_FOLDER = ("a tokenizer_config.json transformers 4.34 reads (a known tokenizer_class such as "
                 "PreTrainedTokenizerFast, no list-valued extra_special_tokens), a tokenizer.json tokenizers 0.14 "
                 "parses (BPE merges as strings, Metaspace with add_prefix_space) and rope_theta at the top level of "
                 "config.json; config.json here names the folder in base_model_name_or_path")


def commands(ctx: ExportContext, out: str, target: str) -> dict:
    return {"python": "from medusa.model.medusa_model import MedusaModel\n"
                      f"model = MedusaModel.from_pretrained({out!r})  # base model: {target}\n"
                      "# then model.medusa_generate(input_ids, temperature=0.0, max_steps=64)",
            "vllm": f"LLM(model={target!r}, speculative_config={{'method': 'medusa', 'model': {out!r}, "
                    f"'num_speculative_tokens': {ctx.head.num_steps}}})"}
