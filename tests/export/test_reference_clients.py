"""Our `eagle` and `medusa` exports, run by the reference code those formats are named after, unmodified:
SafeAILab EAGLE (``EaModel.from_pretrained`` + ``eagenerate``) and FasterDecoding Medusa (``MedusaModel`` +
``medusa_generate``), from ../shared/clients, each in its own venv (scripts/engine_env.sh eagle_ref | medusa_ref).

What must hold, at temperature 0:
- no tensor the client builds is missing from the export and left at its initialisation (loading is strict=False
  in both): what the client does not read from our files must equal the target's tensor of the same role;
- the client's greedy output is HF's greedy output;
- a trained head's drafts are accepted clearly more often than an untrained one's;
- the client's transformers 4.x reads the target folder's rotary base as transformers 5 does.

EAGLE-1 and Medusa run on stories260K (seconds). SafeAILab's EAGLE-3 captures layers (2, L//2, L-3), which repeat
on stories260K's 5 layers, so EAGLE-3 runs on SmolLM2-135M with the engine tests' cached fixture head.
The clients read a target folder with more in it than the project's (export READMEs say so): ``client_target``
builds one beside the real weights. Skips without the venvs unless REQUIRE_ENGINES=1.
Run: pytest tests/export/test_reference_clients.py -m engine -x -q
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine_helpers import (PROMPTS, engine_env, fixture_heads, greedy_answers, new_head, prompt_ids, run_in, save,
                            skip_or_fail, train_fixture_head)

pytestmark = [pytest.mark.engine, pytest.mark.shared, pytest.mark.slow]
STORY_PROMPTS = ["Once upon a time, there was a little dog", "Lily wanted to play in the park", "The sun was hot",
                 "Tom had a red ball. One day"]
NEW_TOKENS = 32


def clients() -> Path:
    from heads.target import shared_dir

    path = shared_dir() / "clients"
    if not path.exists():
        skip_or_fail(f"no reference clients at {path}")
    return path


def legacy_tokenizer(node):
    """tokenizer.json in the schema tokenizers 0.14 (Medusa's pin) parses: Metaspace's add_prefix_space instead of
    prepend_scheme/split, BPE merges as "a b" strings, no ignore_merges. Same vocabulary, same ids."""
    if isinstance(node, list):
        return [legacy_tokenizer(v) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "Metaspace":
        node = {k: v for k, v in node.items() if k not in ("prepend_scheme", "split")}
        node["add_prefix_space"] = True
    if node.get("type") == "BPE":
        node = {k: v for k, v in node.items() if k != "ignore_merges"}
        node["merges"] = [m if isinstance(m, str) else " ".join(m) for m in node["merges"]]
    return {k: legacy_tokenizer(v) for k, v in node.items()}


def client_target(src: Path, out: Path) -> Path:
    """The target folder as the clients read it: the same weights, plus what transformers 4.x and SafeAILab need:
    model.safetensors.index.json (cnets.py finds the embedding through it), a tokenizer_config a 4.x AutoTokenizer
    opens (with use_fast=False too: tokenizer_class PreTrainedTokenizerFast; no list-valued extra_special_tokens,
    which 4.x cannot read) and a tokenizer.json old tokenizers parse. config.json is ours unchanged: it must
    already read alike."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (src / name).exists():
            (out / name).symlink_to(src / name)
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    (out / "tokenizer.json").write_text(json.dumps(legacy_tokenizer(tokenizer)))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok = {k: v for k, v in tok.items() if k not in ("extra_special_tokens", "chat_template", "backend")}
    (out / "tokenizer_config.json").write_text(json.dumps({**tok, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def export_to(head_dir: Path, fmt: str, out: Path, target_dir: Path) -> Path:
    from export.main import export

    return export({"head_path": str(head_dir), "format": fmt, "out": str(out), "target_path": str(target_dir)})


def our_inv_freq(target) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(target.model.config).inv_freq


def assert_greedy(outputs: list[dict], answers: list[list[int]], eos: int):
    """The client's tokens are HF's greedy tokens (clients may overshoot max_new_tokens by a round: compare the
    common prefix, which must reach HF's EOS or NEW_TOKENS)."""
    for out, want in zip(outputs, answers):
        n = min(len(out["tokens"]), len(want))
        assert out["tokens"][:n] == want[:n], (out["tokens"], want)
        assert n >= NEW_TOKENS or want[n - 1] == eos


def eagle_accepted(report: dict) -> float:
    """Mean drafts accepted per verification round (each round also emits one token of the target's own)."""
    return sum(o["new"] for o in report["outputs"]) / sum(o["rounds"] for o in report["outputs"]) - 1


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    from heads.target import load_target, resolve_path

    target = load_target("stories260k")
    tmp = tmp_path_factory.mktemp("reference-clients")
    prompts = [target.tokenizer(p).input_ids for p in STORY_PROMPTS]
    answers = greedy_answers(target, prompts, NEW_TOKENS)
    return {"target": target, "tmp": tmp, "prompts": prompts, "answers": answers,
            "client_dir": client_target(Path(resolve_path("stories260k", None)), tmp / "target"),
            "prompts_json": (tmp / "prompts.json", (tmp / "prompts.json").write_text(json.dumps(prompts)))[0]}


def test_safeailab_eagle1_runs_our_export(stories):
    venv = engine_env("eagle_ref")
    target, tmp = stories["target"], stories["tmp"]
    heads = {"trained": train_fixture_head("eagle", target, stories["prompts"], stories["answers"], steps=60),
             "untrained": new_head("eagle", target, seed=1)}
    reports = {}
    for name, head in heads.items():
        out = export_to(save(head, target, tmp / f"eagle-{name}"), "eagle", tmp / f"eagle-{name}-export",
                        stories["client_dir"])
        reports[name] = json.loads(run_in(venv, "eagle_ref.py", str(clients() / "SafeAILab-EAGLE-cb7e084"),
                                          str(stories["client_dir"]), str(out), str(stories["prompts_json"]),
                                          str(NEW_TOKENS)))
    for report in reports.values():
        assert report["missing"] == {"embed_tokens.weight": "equals the target's"}  # cnets1 loads it: load_emb
        assert report["unused"] == [] and report["loaded_equal"]
        assert_greedy(report["outputs"], stories["answers"], target.model.config.eos_token_id)
    torch.testing.assert_close(torch.tensor(reports["trained"]["inv_freq"]), our_inv_freq(target))
    trained, untrained = eagle_accepted(reports["trained"]), eagle_accepted(reports["untrained"])
    print(f"[reference] SafeAILab EAGLE-1 on stories260K: accepted/round trained {trained:.2f}, "
          f"untrained {untrained:.2f}")
    assert trained > 1.0 and trained > untrained + 0.75


def test_fastdecoding_medusa_runs_our_export_with_every_head(stories):
    venv = engine_env("medusa_ref")
    target, tmp = stories["target"], stories["tmp"]
    trained = train_fixture_head("medusa", target, stories["prompts"], stories["answers"], steps=150, num_steps=5)
    heads = {"trained": trained, "untrained": new_head("medusa", target, seed=1, randomize=True, num_steps=5)}
    hidden = torch.randn(1, 6, target.dims.hidden_size, generator=torch.Generator().manual_seed(0))
    save_file({"hidden": hidden}, str(tmp / "hidden.safetensors"))
    reports = {}
    for name, head in heads.items():
        out = export_to(save(head, target, tmp / f"medusa-{name}"), "medusa", tmp / f"medusa-{name}-export",
                        stories["client_dir"])
        logits_file = tmp / f"medusa-{name}-logits.safetensors"
        reports[name] = json.loads(run_in(venv, "medusa_ref.py", str(clients() / "FasterDecoding-Medusa-e2a5d20"),
                                          str(out), str(stories["prompts_json"]), str(NEW_TOKENS),
                                          str(tmp / "hidden.safetensors"), str(logits_file)))
        client_logits = load_file(str(logits_file))
        with torch.no_grad():  # every head the client built is one of ours, computing what ours computes
            for k in range(head.num_steps):
                torch.testing.assert_close(client_logits[f"head{k}"], head.head_logits(hidden, k), atol=1e-5,
                                           rtol=1e-5)
    for report in reports.values():
        assert report["heads"] == 5 and report["missing"] == [] and report["unused"] == [] and report["loaded_equal"]
        assert_greedy(report["outputs"], stories["answers"], target.model.config.eos_token_id)
    torch.testing.assert_close(torch.tensor(reports["trained"]["inv_freq"]), our_inv_freq(target))
    accepted = {name: [a for o in r["outputs"] for a in o["accepted"]] for name, r in reports.items()}
    mean = {name: sum(a) / len(a) for name, a in accepted.items()}
    print(f"[reference] FasterDecoding Medusa on stories260K: accepted/round trained {mean['trained']:.2f}, "
          f"untrained {mean['untrained']:.2f}; rounds accepting all 5 drafts: {accepted['trained'].count(5)}")
    assert mean["trained"] > 1.0 and mean["trained"] > mean["untrained"] + 0.75


@pytest.mark.skipif(os.environ.get("DRAFTHEADS_SKIP_SMOLLM2") == "1", reason="DRAFTHEADS_SKIP_SMOLLM2=1")
def test_safeailab_eagle3_runs_our_export_with_the_targets_embedding(tmp_path):
    """The defect this format had: config.json's target_hidden_size made cnets.py keep a random embedding."""
    from heads.target import load_target

    venv = engine_env("eagle_ref")
    target = load_target("smollm2-135m")
    prompts = prompt_ids(target)
    answers = greedy_answers(target, prompts)
    heads = fixture_heads(target, prompts, answers, families=("eagle3",))
    client_dir = client_target(Path(target.model.name_or_path), tmp_path / "target")
    prompts_json = tmp_path / "prompts.json"
    n = 3  # prompts the client decodes: SmolLM2 on CPU costs ~1 s per tree round
    prompts_json.write_text(json.dumps(prompts[:n]))
    reports = {}
    for name in ("eagle3", "eagle3_random"):
        out = export_to(heads[name], "eagle", tmp_path / name, client_dir)
        reports[name] = json.loads(run_in(venv, "eagle_ref.py", str(clients() / "SafeAILab-EAGLE-cb7e084"),
                                          str(client_dir), str(out), str(prompts_json), str(NEW_TOKENS), "--eagle3"))
    for report in reports.values():
        assert report["missing"] == {"embed_tokens.weight": "equals the target's"}
        assert report["unused"] == [] and report["loaded_equal"]
        assert_greedy(report["outputs"], [a[:NEW_TOKENS] for a in answers[:n]], target.model.config.eos_token_id)
    torch.testing.assert_close(torch.tensor(reports["eagle3"]["inv_freq"]), our_inv_freq(target))
    trained, untrained = eagle_accepted(reports["eagle3"]), eagle_accepted(reports["eagle3_random"])
    print(f"[reference] SafeAILab EAGLE-3 on SmolLM2-135M ({len(PROMPTS[:n])} prompts): accepted/round trained "
          f"{trained:.2f}, untrained {untrained:.2f}")
    assert trained > 1.0 and trained > untrained + 0.75
