"""Load a `speculators` checkpoint with ``SpeculatorModel.from_pretrained`` (run with .venvs/vllm/bin/python).

Files in, JSON out; imports nothing of draftheads. Reports what the loader built and whether every tensor in the
file landed in a parameter/buffer with the same value (HF loaders skip unknown keys silently, so this is checked
here rather than trusted), and which of the model's own tensors the file did not provide.

    python speculators_load.py DIR out.json
"""
import json
import sys
from pathlib import Path


def main():
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    import torch
    from safetensors.torch import load_file
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(str(src))
    state = model.state_dict()
    file = load_file(str(src / "model.safetensors"))
    mismatched = [k for k, v in file.items() if k in state and not torch.equal(state[k].cpu().to(v.dtype), v)]
    cfg = model.config
    report = {
        "class": type(model).__name__,
        "unused_file_keys": sorted(k for k in file if k not in state),
        "model_keys_not_in_file": sorted(k for k in state if k not in file),
        "mismatched": mismatched,
        "norm_before_residual": getattr(cfg, "norm_before_residual", None),
        "eagle_aux_hidden_state_layer_ids": getattr(cfg, "eagle_aux_hidden_state_layer_ids", None),
        "draft_vocab_size": getattr(cfg, "draft_vocab_size", None),
        "speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens,
        "verifier": cfg.speculators_config.verifier.name_or_path,
        "layer_model_type": cfg.transformer_layer_config.model_type,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
