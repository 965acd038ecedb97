"""The HF layout llama.cpp's ``convert_hf_to_gguf.py --target-model-dir`` turns into an EAGLE-3 GGUF.

Checked against llama.cpp as vendored by llama-cpp-python 0.3.36:
- conversion/llama.py ``LlamaModel``: a draft is detected by ``draft_vocab_size`` in config.json with
  ``num_hidden_layers == 1``; the aux ids come from top-level ``eagle_aux_hidden_state_layer_ids`` (else
  [2, L//2, L-3] from the target's config), target_hidden_size from the draft config (else the target's),
  norm_before_residual / norm_before_fc (default false); midlayer.* -> model.layers.0.*, hidden_norm ->
  attn_norm_2, fc.weight kept, d2t stored as int64, t2d dropped (so not written). The tokenizer and vocab come
  from --target-model-dir.
- src/models/eagle3.cpp: exactly 3 extract layers; d2t optional (without it the draft vocab is the target's);
  the target's token embedding is used when the draft has none.
- common/speculative.cpp ``common_speculative_impl_draft_eagle3``: each id k < n_layer reads
  ``llama_get_embeddings_layer_inp(ctx_tgt, k)`` (the input of layer k, our convention) and the features are
  concatenated in the order the ids are written (not sorted), so the ids are written ascending with fc laid out
  to match.
"""
from __future__ import annotations

from export import vllm
from export.common import ExportContext, Written, target_path_or_placeholder
from export.reference import eagle3

FAMILIES = ("eagle3",)
GGUF = "draft-eagle3.gguf"


def write(ctx: ExportContext) -> Written:
    written = vllm.write(ctx)  # the SpecForge/yuhuili layout vLLM also reads: midlayer.*, fc, norm, lm_head, d2t
    ids, L = written.config["eagle_aux_hidden_state_layer_ids"], ctx.dims.num_layers
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= k < L for k in ids):
        raise ValueError(f"llama.cpp needs exactly three distinct aux ids < {L}; got {ids}")
    written.config["norm_before_fc"] = False
    written.extra["convert.sh"] = convert_script(ctx).encode()
    return written


def required(ctx: ExportContext) -> dict:
    return {**vllm.required(ctx), "norm_before_fc": False}


def expected(cfg: dict, family: str) -> dict:
    return vllm.expected(cfg, family)


def reference_logits(cfg: dict, tensors: dict, family: str, target, feats, K: int):
    L = target.dims.num_layers
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
    mapped = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k != "t2d"}
    return eagle3(mapped, cfg, target.embed_tokens.weight.float(), list(ids),  # written order, not sorted
                  cfg.get("norm_before_residual", False), feats, K, "layers.0")


def convert_script(ctx: ExportContext) -> str:
    return f"""#!/usr/bin/env bash
# Convert this EAGLE-3 draft to a GGUF for llama.cpp (--spec-type draft-eagle3).
#   LLAMA_CPP=/path/to/llama.cpp TARGET=/path/to/target-hf-dir bash convert.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${{LLAMA_CPP:?set LLAMA_CPP to a llama.cpp checkout (convert_hf_to_gguf.py)}}"
TARGET="${{TARGET:-{target_path_or_placeholder(ctx)}}}"
python "$LLAMA_CPP/convert_hf_to_gguf.py" "$here" --target-model-dir "$TARGET" --outtype f32 --outfile "$here/{GGUF}"
"""


def commands(ctx: ExportContext, out: str, target: str) -> dict:
    return {
        "convert": f"LLAMA_CPP=/path/to/llama.cpp TARGET={target} bash {out}/convert.sh",
        "convert_target": f"python $LLAMA_CPP/convert_hf_to_gguf.py {target} --outtype f32 --outfile target.gguf",
        "run": f"llama-speculative-simple -m target.gguf -md {out}/{GGUF} --spec-type draft-eagle3 "
               f"--spec-draft-n-max {ctx.gamma} -p 'Once upon a time' -n 64 --temp 0 --top-k 1 --seed 42",
    }
