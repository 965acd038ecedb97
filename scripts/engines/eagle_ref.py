"""Run an `eagle` export through SafeAILab's own EaModel (their source from ../shared/clients on sys.path), in the
eagle_ref venv (transformers 4.53.3). Prints one JSON object:

- ``missing``: draft-layer tensors the export's file does not hold (EaModel loads it with strict=False), each with
  whether the client's value equals the target's tensor of the same role (embed_tokens) or was left at its init;
- ``unused``: file keys the draft layer has no parameter for (silently dropped);
- ``inv_freq``: the rotary frequencies its Llama built from the target's config.json;
- ``outputs``: eagenerate's new tokens per prompt at temperature 0, with rounds and new tokens (mean accepted
  drafts per round = new / rounds - 1).

    python eagle_ref.py CLIENT_SRC TARGET_DIR EXPORT_DIR PROMPTS_JSON MAX_NEW_TOKENS [--eagle3]
"""
import json
import sys

import torch

src, target_dir, export_dir, prompts_json, max_new = sys.argv[1:6]
use_eagle3 = "--eagle3" in sys.argv
sys.path.insert(0, src)
torch.set_num_threads(1)

from eagle.model.ea_model import EaModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

model = EaModel.from_pretrained(use_eagle3=use_eagle3, base_model_path=target_dir, ea_model_path=export_dir,
                                total_token=30, depth=4, top_k=8, torch_dtype=torch.float32)
model.eval()
written = load_file(f"{export_dir}/model.safetensors")
layer = model.ea_layer.state_dict()
target_embed = model.base_model.model.embed_tokens.weight
missing = {}
for key in sorted(set(layer) - set(written)):
    from_target = key == "embed_tokens.weight" and torch.equal(layer[key].float(), target_embed.float())
    missing[key] = "equals the target's" if from_target else "left at its initialisation"
loaded_equal = all(torch.equal(layer[k].float(), written[k].float()) for k in set(layer) & set(written))

outputs = []
for ids in json.load(open(prompts_json)):
    out, new, rounds = model.eagenerate(torch.tensor([ids]), temperature=0.0, max_new_tokens=int(max_new),
                                        max_length=256, log=True)
    outputs.append({"tokens": out[0, len(ids):].tolist(), "new": int(new), "rounds": int(rounds) + 1})
# the rotary frequencies its transformers 4.x Llama built from the target's config.json (rope_theta at top level)
inv_freq = model.base_model.model.layers[0].self_attn.rotary_emb.inv_freq.tolist()
print(json.dumps({"inv_freq": inv_freq, "missing": missing, "unused": sorted(set(written) - set(layer)),
                  "loaded_equal": loaded_equal,
                  "outputs": outputs}))
