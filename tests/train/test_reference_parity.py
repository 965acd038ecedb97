"""scripts/reference_parity.py at a few steps: our EAGLE-3 trainer and SafeAILab's reference trainer (in the
eagle_ref venv) on the same ~1.2k trained tokens, both exported in the ``eagle`` layout, both read back and measured.

Skips without the eagle_ref venv (scripts/engine_env.sh eagle_ref) unless REQUIRE_ENGINES=1, which fails instead.
Run: pytest tests/train/test_reference_parity.py -m slow -q   (~3 min on 2 cores, the held-out answers cached)
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytestmark = [pytest.mark.slow, pytest.mark.shared, pytest.mark.engine]
ROOT = Path(__file__).resolve().parents[2]
TOKENS, DRAFT_VOCAB = 1200, 128


def parity_module():
    spec = importlib.util.spec_from_file_location("reference_parity", ROOT / "scripts" / "reference_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensors(path: Path) -> dict:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from heads.target import engine_venvs

    venvs = engine_venvs()
    if not (venvs / "eagle_ref" / ".stamp").exists():
        reason = f"no eagle_ref venv under {venvs} (bash scripts/engine_env.sh eagle_ref)"
        if os.environ.get("REQUIRE_ENGINES") == "1":
            pytest.fail(f"REQUIRE_ENGINES=1 but {reason}")
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("parity")
    cmd = [sys.executable, str(ROOT / "scripts" / "reference_parity.py"), "--tokens", str(TOKENS), "--out", str(out),
           "--draft-vocab", str(DRAFT_VOCAB), "--eval-override", "data.max_eval_records=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "parity.json").read_text())


def test_both_heads_train_on_the_same_text_and_are_measured_alike(parity):
    out, result = parity
    text = result["text"]
    assert text["trained_tokens"] >= TOKENS and text["records"] % 8 == 0
    records = [json.loads(line) for line in open(out / "train.jsonl")]
    assert len(records) == text["records"] and all(r["messages"][-1]["role"] == "assistant" for r in records)
    ours, ref = result["ours"], result["reference"]
    for head in (ours, ref):
        assert head["trained_tokens"] == text["trained_tokens"]
        assert len(head["alpha"]) == 3 and head["heldout_tokens"] > 0
        assert head["train_seconds"] > 0
        assert head["tokens_per_s"] == pytest.approx(head["trained_tokens"] / head["train_seconds"], rel=0.01)
    assert ours["train_steps"] == text["records"] // 8  # one epoch of the recipe's batches of 8
    assert ref["optimizer_steps"] == text["records"] // 2  # micro-batches of 1, two per step (ds_config.json)
    assert ref["lr"]["peak"] == 5e-5 and ref["lr"]["total_steps"] == ref["optimizer_steps"]
    assert ours["command"].replace("ours-eval", "X") == ref["command"].replace("reference-eval", "X")


def test_each_figure_is_its_own_heads_test_split_alpha(parity):
    """What parity.json reports is what train/acceptance.py measured on the test split, for the head each trainer
    wrote: a script that measured one head twice, read validation, or read training α fails here."""
    out, result = parity
    measured = {}
    for name in ("ours", "reference"):
        record, head = json.loads((out / f"{name}-eval" / "acceptance.json").read_text()), result[name]
        assert head["alpha"] == [round(a, 4) for a in record["test"]["alpha"]]
        assert head["alpha_validation"] == [round(a, 4) for a in record["alpha"]]
        assert head["heldout_tokens"] == record["test"]["num_tokens"]
        keys = record["heldout_prompt_keys"]
        assert keys["test"] and not set(keys["test"]) & set(keys["validation"])  # measured on prompts nothing chose on
        # a chain of 3 drafts emits 1 + the accepted ones per round; each position's acceptances bound its share
        assert 1.0 <= head["tau"] <= 1.0 + sum(head["alpha"]) + 1e-3
        with safe_open(str(out / f"{name}-eval" / "head" / "model.safetensors"), "pt") as f:
            measured[name] = f.get_tensor("lm_head.weight")
        with safe_open(str(out / name / "model.safetensors"), "pt") as f:
            assert torch.equal(measured[name], f.get_tensor("lm_head.weight"))  # the exported head, read back
    assert not torch.equal(measured["ours"], measured["reference"])


def test_both_heads_are_written_in_the_eagle_layout(parity):
    out, _ = parity
    ours, ref = tensors(out / "ours"), tensors(out / "reference")
    assert ours == ref  # the same tensor names and shapes: SafeAILab's client loads either
    assert ref["lm_head.weight"] == (DRAFT_VOCAB, 576) and ref["fc.weight"] == (576, 3 * 576)
    for name in ("ours", "reference"):
        config = json.loads((out / name / "config.json").read_text())
        assert config["draft_vocab_size"] == DRAFT_VOCAB and config["rope_theta"] == 100000.0
    assert not (out / "reference-run" / "cache.pt").exists()  # scandata's cache is the run's, not left behind


def test_heads_that_saw_different_text_are_refused(capsys):
    module = parity_module()
    text = {"sha256": "a" * 64, "trained_tokens": 1000}
    module.check_same_text(text, {"trained_tokens": 1000}, {"data_sha256": "a" * 64, "trained_tokens": 1000})
    for ours, ref in (({"trained_tokens": 1000}, {"data_sha256": "b" * 64, "trained_tokens": 1000}),
                      ({"trained_tokens": 992}, {"data_sha256": "a" * 64, "trained_tokens": 1000})):
        with pytest.raises(SystemExit):
            module.check_same_text(text, ours, ref)
        err = capsys.readouterr().err
        assert err.startswith("error: the two heads saw different text") and err.count("\n") == 1
