"""The README every export directory gets: what it is, the command that serves it, what was measured and checked."""
from __future__ import annotations

import json

from export.common import ExportContext

ENGINES = {
    "vllm": "vLLM 0.32 (speculative_config model directory)",
    "sglang": "SGLang (--speculative-draft-model-path)",
    "speculators": "the speculators format (speculators 0.9.0; vLLM serves the directory itself)",
    "llamacpp": "llama.cpp (convert with convert_hf_to_gguf.py --target-model-dir, run --spec-type draft-eagle3)",
    "eagle": "SafeAILab's EAGLE reference code (EaModel.from_pretrained)",
    "medusa": "FasterDecoding's Medusa reference code (MedusaModel.from_pretrained)",
    "mtp": "DeepSeek-V3's MTP key layout (no engine serves MTP for a Llama target)",
}


def summarize_acceptance(acceptance: dict) -> list[str]:
    lines = []
    for key in ("temperature", "alpha", "tau", "tau_predicted", "alpha_untrained", "num_tokens"):
        if key in acceptance:
            lines.append(f"- {key}: {json.dumps(acceptance[key])}")
    return lines or [f"- {json.dumps(acceptance)}"]


def render_readme(fmt: str, module, ctx: ExportContext, meta: dict, out: str) -> str:
    target = ctx.target_path or "/path/to/target"
    lines = [
        f"# {ctx.family} draft head for {ENGINES[fmt]}",
        "",
        f"Exported by draftheads from `{meta['head_path']}` for target `{ctx.target_identity.get('name')}` "
        f"(hidden {ctx.dims.hidden_size}, vocab {ctx.dims.vocab_size}, {ctx.dims.num_layers} layers, tokenizer "
        f"sha256 {str(ctx.target_identity.get('tokenizer_sha256'))[:16]}...).",
        "",
        "## Export command",
        "",
        "```bash",
        f"python export/main.py head_path={meta['head_path']} format={fmt} out={out}",
        "```",
        "",
        "## Engine command",
        "",
    ]
    for name, command in module.commands(ctx, out, target).items():
        lang = "python" if name in ("python", "load") or command.startswith(("from ", "LLM(")) else "bash"
        lines += [f"{name}:", "", f"```{lang}", command, "```", ""]
    if getattr(module, "TARGET_FOLDER", None):
        lines += [f"Target folder: this client also needs {module.TARGET_FOLDER}.", ""]
    if fmt == "mtp":
        lines += ["No serving engine runs MTP modules on a Llama target (vLLM's and SGLang's MTP proposers belong to",
                  "specific target architectures and read these layers from the target's own checkpoint). Decode with",
                  "draftheads' serve/ from the native head; this layout is for tools that read DeepSeek-V3's keys.", ""]
    if "eagle_aux_hidden_state_layer_ids" in meta or "eagle_config" in meta:
        ids = meta.get("eagle_aux_hidden_state_layer_ids", (meta.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"))
        reads = ctx.head_config["hparams"].get("aux_layers")
        lines += [f"Aux layers written: {ids} (the head reads hidden_states {reads}; ids are in this engine's own "
                  "convention, fc re-laid to match).", ""]
    lines += ["## Drafting settings", "", f"- num_speculative_tokens (γ): {ctx.gamma}"]
    if ctx.recommended:
        shown = {k: v for k, v in ctx.recommended.items() if k not in ("tree_paths", "predicted")}
        lines += [f"- measured by serve/: {json.dumps(shown)}"]
    else:
        lines += ["- serve/ has not measured this head yet; γ is the number of steps it was trained for"]
    if ctx.acceptance:
        lines += ["", "## Acceptance measured at training time (acceptance.json)", "",
                  *summarize_acceptance(ctx.acceptance)]
    v = meta.get("validation", {})
    lines += ["", "## Validation", "",
              f"Exact key set ({v.get('tensors')} tensors), shapes, dtypes and config fields as the engine builds "
              "them; "
              "target identity; and a reference forward reading these files as the engine does reproduced the "
              f"head's training logits on a {v.get('probe_tokens')} probe: max |diff| per draft step "
              f"{v.get('max_abs_logit_diff')}.", ""]
    return "\n".join(lines)
