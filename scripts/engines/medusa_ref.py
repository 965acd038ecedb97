"""Run a `medusa` export through FasterDecoding's own MedusaModel (their source from ../shared/clients on sys.path),
in the medusa_ref venv (transformers 4.34.1). Prints one JSON object:

- ``heads``: how many heads the client built; ``missing`` / ``unused``: head tensors the file lacks (left at their
  init: loading is strict=False) or holds for no head; ``loaded_equal``: every built tensor equals the file's;
- ``inv_freq``: the rotary frequencies its Llama built from the target's config.json;
- ``head_logits``: the client's medusa_head[k] on the hidden states in HIDDEN (a safetensors file, key "hidden"),
  so the caller can compare them with its own head's;
- ``outputs``: medusa_generate at temperature 0 with a tree that reaches every head (Medusa's default tree stops
  at depth 4), tokens per prompt and the accepted drafts of each round. medusa_generate yields only text, so its
  ``update_inference_inputs`` is wrapped to observe (not change) the tokens and accept lengths.

    python medusa_ref.py CLIENT_SRC EXPORT_DIR PROMPTS_JSON MAX_NEW_TOKENS HIDDEN OUT_LOGITS
"""
import json
import sys

import torch

src, export_dir, prompts_json, max_new, hidden_file, out_logits = sys.argv[1:7]
sys.path.insert(0, src)
torch.set_num_threads(1)

import medusa.model.medusa_model as mm  # noqa: E402
from medusa.model.medusa_choices import mc_sim_7b_63  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

model = mm.MedusaModel.from_pretrained(export_dir, torch_dtype=torch.float32)
model.eval()
written = torch.load(f"{export_dir}/medusa_lm_head.pt", map_location="cpu")
built = model.medusa_head.state_dict()
missing = sorted(set(built) - set(written))
loaded_equal = all(torch.equal(built[k], written[k]) for k in set(built) & set(written))
with torch.no_grad():
    hidden = load_file(hidden_file)["hidden"]
    save_file({f"head{k}": head(hidden).contiguous() for k, head in enumerate(model.medusa_head)}, out_logits)

rounds: list[int] = []
state = {}
observed = mm.update_inference_inputs


def observe(input_ids, candidates, best_candidate, accept_length, *args):
    rounds.append(int(accept_length))
    out = observed(input_ids, candidates, best_candidate, accept_length, *args)
    state["ids"] = out[0]
    return out


mm.update_inference_inputs = observe
tree = mc_sim_7b_63 + [[0, 0, 0, 0, 0]]  # one path five deep: the fifth head drafts too
outputs = []
for ids in json.load(open(prompts_json)):
    rounds.clear()
    for _ in model.medusa_generate(torch.tensor([ids]), temperature=0.0, max_steps=int(max_new),
                                   medusa_choices=tree):
        if state["ids"].shape[1] - len(ids) >= int(max_new):
            break
    outputs.append({"tokens": state["ids"][0, len(ids):].tolist(), "accepted": list(rounds)})
inv_freq = model.model.layers[0].self_attn.rotary_emb.inv_freq.tolist()  # from the target's config.json
print(json.dumps({"inv_freq": inv_freq, "heads": len(model.medusa_head), "missing": missing,
                  "unused": sorted(set(written) - set(built)),
                  "loaded_equal": loaded_equal, "outputs": outputs}))
