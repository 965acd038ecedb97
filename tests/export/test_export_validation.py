"""Fast tier: the exporter's checks catch what engines would silently get wrong, and refusals say what works."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from export import ExportRefused, formats_for
from export.main import METADATA, prepare, probe_features, validate_export
from export.validate import check_vocab_map

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exported(tiny_target, head_dir, run_export, tmp_path):
    """exported(family, fmt, **hp) -> (out, ctx, feats): a valid export plus what re-validating a copy needs."""
    def make(family, fmt, **hp):
        head_path, _ = head_dir(tiny_target, family, **hp)
        out = run_export(head_path, fmt, tmp_path / f"{family}-{fmt}")
        _, ctx = prepare(head_path, fmt)
        return out, ctx, probe_features(ctx.target, 16)

    return make


def corrupt(out: Path, fmt, tensors=None, config=None):
    """Apply edits to the written files; tensors(dict) / config(dict) mutate in place."""
    weights = out / ("medusa_lm_head.safetensors" if fmt == "medusa" else "model.safetensors")
    if tensors:
        t = load_file(str(weights))
        tensors(t)
        save_file(t, str(weights))
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))


def test_valid_export_revalidates(exported):
    out, ctx, feats = exported("eagle3", "vllm", draft_vocab_size=64)
    report = validate_export(out, "vllm", ctx, feats)
    assert report["steps_checked"] == 3 and max(report["max_abs_logit_diff"]) < 1e-4


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("norm.weight"), "missing \\['norm.weight'\\]"),
    (lambda t: t.update({"embed_tokens.weight": torch.zeros(259, 64)}), "unused \\['embed_tokens.weight'\\]"),
    (lambda t: t.update({"fc.weight": t["fc.weight"][:, :128].contiguous()}), "fc.weight: shape"),
    (lambda t: t.update({"d2t": t["d2t"].int()}), "d2t: dtype"),
    (lambda t: t.update({"d2t": t["d2t"].flip(0).contiguous()}), "strictly ascending"),
    (lambda t: t.update({"d2t": t["d2t"] + (torch.arange(64) == 63).long()}), "other target ids"),
    (lambda t: t.update({"midlayer.mlp.gate_proj.weight": t["midlayer.mlp.up_proj.weight"].clone(),
                         "midlayer.mlp.up_proj.weight": t["midlayer.mlp.gate_proj.weight"].clone()}),
     "reference forward differs"),
])
def test_corrupted_tensors_are_caught(exported, edit, message):
    out, ctx, feats = exported("eagle3", "vllm", draft_vocab_size=64)
    corrupt(out, "vllm", tensors=edit)
    with pytest.raises(ValueError, match=message):
        validate_export(out, "vllm", ctx, feats)


@pytest.mark.parametrize("fmt,edit,message", [
    # vLLM's speculators reader defaults norm_before_residual to true: an absent flag changes the computation.
    ("speculators", lambda c: c.pop("norm_before_residual"), "lacks 'norm_before_residual'"),
    ("vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 6]), "eagle_aux_hidden_state_layer_ids"),
    ("sglang", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]), "eagle_config"),
    ("vllm", lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
])
def test_config_fields_are_checked(exported, fmt, edit, message):
    out, ctx, feats = exported("eagle3", fmt, draft_vocab_size=64)
    corrupt(out, fmt, config=edit)
    with pytest.raises(ValueError, match=message):
        validate_export(out, fmt, ctx, feats)


@pytest.mark.parametrize("fmt,edit", [
    ("speculators", lambda c: c.pop("norm_before_residual")),  # read as true by vLLM
    ("vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 6])),  # one layer off
    ("sglang", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5])),  # vLLM's ids
    ("llamacpp", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[5, 4, 2])),  # llama.cpp keeps written order
])
def test_reference_forward_has_teeth(exported, fmt, edit):
    """The same mistakes, seen by the engine-style forward alone (config field checks bypassed)."""
    out, ctx, feats = exported("eagle3", fmt, draft_vocab_size=64)
    corrupt(out, fmt, config=edit)
    from export import format_module
    from export.common import read_dir
    from export.validate import check_forward, head_logits

    cfg, tensors = read_dir(out)
    module = format_module(fmt, "eagle3")
    ref = module.reference_logits(cfg, tensors, "eagle3", ctx.target, feats, 3)
    trained = head_logits(ctx.head_config, ctx.head.state_dict(), ctx.target, feats, 3, ctx.dtype)
    with pytest.raises(ValueError, match="reference forward differs"):
        check_forward(ref, trained, atol=1e-4)


def test_sglang_eagle1_needs_its_zero_bias(exported):
    out, ctx, feats = exported("eagle", "sglang")
    corrupt(out, "sglang", tensors=lambda t: t.pop("fc.bias"))  # SGLang would keep a random init bias
    with pytest.raises(ValueError, match="missing \\['fc.bias'\\]"):
        validate_export(out, "sglang", ctx, feats)


def test_safeailab_eagle3_embedding_follows_the_clients_rule(exported):
    """cnets.py skips the target's embedding when config.json has target_hidden_size; the draft then reads
    embed_tokens.weight from its own file, else keeps a random one. The checks read the files by that rule."""
    out, ctx, feats = exported("eagle3", "eagle", draft_vocab_size=64)
    assert "target_hidden_size" not in json.loads((out / "config.json").read_text())
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    corrupt(out, "eagle", config=lambda c: c.update(target_hidden_size=64))  # the defect, reintroduced
    with pytest.raises(ValueError, match="missing \\['embed_tokens.weight'\\]"):
        validate_export(out, "eagle", ctx, feats)
    from export.eagle import reference_logits
    from export.common import read_dir
    with pytest.raises(ValueError, match="random token embedding"):  # the forward alone refuses it too
        reference_logits(*read_dir(out), "eagle3", ctx.target, feats, 3)
    random_embed = torch.randn(ctx.dims.vocab_size, 64)
    corrupt(out, "eagle", tensors=lambda t: t.update({"embed_tokens.weight": random_embed}))
    with pytest.raises(ValueError, match="reference forward differs"):  # the forward uses the file's embedding
        validate_export(out, "eagle", ctx, feats)
    corrupt(out, "eagle", tensors=lambda t: t.update({"embed_tokens.weight": ctx.target.embed_tokens.weight.clone()}))
    validate_export(out, "eagle", ctx, feats)  # carrying the target's own embedding is the other valid layout


def test_medusa_pickle_must_match(exported):
    out, ctx, feats = exported("medusa", "medusa", num_steps=5)
    torch.save({"0.0.linear.weight": torch.zeros(1)}, out / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="differ"):
        validate_export(out, "medusa", ctx, feats)


def test_medusa_keys_are_the_five_heads_its_loader_builds(exported, tiny_target, head_dir, run_export, tmp_path):
    out, ctx, feats = exported("medusa", "medusa", num_steps=5)

    def four_heads(t):  # what a 4-head export looked like: the client's fifth head stayed random
        for k in [k for k in t if k.startswith("4.")]:
            t.pop(k)

    corrupt(out, "medusa", tensors=four_heads, config=lambda c: c.update(medusa_num_heads=4))
    with pytest.raises(ValueError, match="missing \\['4.0.linear.bias', '4.0.linear.weight', '4.1.weight'\\]"):
        validate_export(out, "medusa", ctx, feats)
    head_path, _ = head_dir(tiny_target, "medusa", name="four", num_steps=4)
    with pytest.raises(ExportRefused, match="always builds 5 heads; this head has 4"):
        run_export(head_path, "medusa", tmp_path / "four")


def test_target_identity_is_checked(exported):
    out, ctx, feats = exported("mtp", "mtp")
    meta = json.loads((out / METADATA).read_text())
    meta["target"]["tokenizer_sha256"] = "0" * 64
    (out / METADATA).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="tokenizer_sha256"):
        validate_export(out, "mtp", ctx, feats)


def test_vocab_map_check():
    d2t = torch.tensor([0, 1, 1, 3])  # targets 0, 2, 3, 6
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[[0, 2, 3, 6]] = True
    assert check_vocab_map(d2t, 8, t2d).tolist() == [0, 2, 3, 6]
    t2d[5] = True
    with pytest.raises(ValueError, match="nonzero\\(t2d\\)"):
        check_vocab_map(d2t, 8, t2d)
    with pytest.raises(ValueError, match="outside"):
        check_vocab_map(torch.tensor([0, 1, 1, 5]), 8)


@pytest.mark.parametrize("family,fmt,can", [
    ("medusa", "speculators", "vllm, medusa"), ("mtp", "vllm", "mtp"), ("eagle", "llamacpp", "vllm, sglang, eagle"),
    ("medusa", "sglang", "vllm, medusa"), ("eagle3", "medusa", "vllm, sglang, speculators, llamacpp, eagle"),
])
def test_refusals_list_what_the_family_can_go_to(tiny_target, head_dir, run_export, tmp_path, family, fmt, can):
    head_path, _ = head_dir(tiny_target, family)
    with pytest.raises(ExportRefused, match=f"cannot carry a {family} head; {family} heads export to: {can}$"):
        run_export(head_path, fmt, tmp_path / "out")
    assert ", ".join(formats_for(family)) == can and not (tmp_path / "out").exists()


def test_safeailab_eagle3_refuses_other_aux_layers(tiny_target, head_dir, run_export, tmp_path):
    head_path, _ = head_dir(tiny_target, "eagle3", aux_layers=[1, 3, 6])
    with pytest.raises(ExportRefused, match="always reads layers"):
        run_export(head_path, "eagle", tmp_path / "out")


@pytest.mark.parametrize("fmt", ["eagle", "llamacpp", "sglang"])
def test_eagle31_heads_are_refused_by_formats_without_their_norms(tiny_target, head_dir, run_export, tmp_path, fmt):
    head_path, _ = head_dir(tiny_target, "eagle3", fc_norm=True)
    with pytest.raises(ExportRefused, match=f"EAGLE 3.1 normalisation .* format={fmt} cannot carry; export it with "
                                            "format=vllm or format=speculators, or retrain it with "
                                            "head.hparams.fc_norm=false head.hparams.norm_output=false$"):
        run_export(head_path, fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize("hp", [{"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True}],
                         ids=["fc_norm", "norm_output", "both"])
def test_eagle31_exports_compute_the_heads_logits(exported, fmt, hp):
    """vLLM 0.32 and speculators 0.9 read fc_norm / norm_output. The fc_norm gains are folded into fc (written norms
    are ones) and repeated aux layers summed; the engine-style forward must still give the head's logits, and the
    same files read as plain EAGLE-3 (the flags dropped) must not."""
    out, ctx, feats = exported("eagle3", fmt, draft_vocab_size=64, aux_layers=[2, 2, 5], **hp)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["fc_norm"], cfg["norm_output"]) == (hp.get("fc_norm", False), hp.get("norm_output", False))
    tensors = load_file(str(out / "model.safetensors"))
    norms = sorted(k for k in tensors if k.startswith("fc_norm."))
    assert norms == ([f"fc_norm.{i}.weight" for i in range(3)] if hp.get("fc_norm") else [])
    assert all(torch.equal(tensors[k], torch.ones(64)) for k in norms)
    report = validate_export(out, fmt, ctx, feats)
    assert report["steps_checked"] == 3 and max(report["max_abs_logit_diff"]) < 1e-4

    from export import format_module
    from export.common import read_dir
    from export.validate import check_forward, head_logits

    cfg, tensors = read_dir(out)
    for flag in hp:  # read as plain EAGLE-3: each dropped norm changes the forward
        plain = {**cfg, flag: False}
        if flag == "fc_norm":
            tensors = {k: v for k, v in tensors.items() if not k.startswith("fc_norm.")}
        ref = format_module(fmt, "eagle3").reference_logits(plain, tensors, "eagle3", ctx.target, feats, 3)
        trained = head_logits(ctx.head_config, ctx.head.state_dict(), ctx.target, feats, 3, ctx.dtype)
        with pytest.raises(ValueError, match="reference forward differs"):
            check_forward(ref, trained, atol=1e-4)


def test_failed_validation_leaves_nothing(tiny_target, head_dir, run_export, tmp_path, monkeypatch):
    from export import vllm

    head_path, _ = head_dir(tiny_target, "eagle")
    real = vllm.write

    def broken(ctx):  # a key map bug: gate/up swapped
        w = real(ctx)
        t = w.tensors
        t["layers.0.mlp.gate_proj.weight"], t["layers.0.mlp.up_proj.weight"] = (t["layers.0.mlp.up_proj.weight"],
                                                                                t["layers.0.mlp.gate_proj.weight"])
        return w

    monkeypatch.setattr(vllm, "write", broken)
    with pytest.raises(ValueError, match="reference forward differs"):
        run_export(head_path, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_hydra_entry_writes_the_files_and_refuses_in_one_line(tiny_target, head_dir, tmp_path, monkeypatch):
    """export/main.py's @hydra.main entry, in-process, with conf/export.yaml."""
    from export.main import _hydra_main

    head_path, _ = head_dir(tiny_target, "eagle3", draft_vocab_size=64)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["export/main.py", f"head_path={head_path}", "format=llamacpp", "out=gguf-src"])
    _hydra_main()
    assert sorted(p.name for p in (tmp_path / "gguf-src").iterdir()) == [
        "README.md", "config.json", "convert.sh", "draftheads_export.json", "model.safetensors"]
    assert "--target-model-dir" in (tmp_path / "gguf-src" / "convert.sh").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf-src", "run"]  # Hydra wrote nothing else
    monkeypatch.setattr(sys, "argv", ["export/main.py", f"head_path={head_path}", "format=medusa", "out=x"])
    with pytest.raises(SystemExit) as refused:
        _hydra_main()
    assert str(refused.value.code) == ("export refused: format 'medusa' cannot carry a eagle3 head; eagle3 heads "
                                       "export to: vllm, sglang, speculators, llamacpp, eagle")


@pytest.mark.parametrize("case,message", [
    ("missing head", "error: head_path=/missing/head: no such directory; pass the head/ directory a training run "
                     "wrote (DIR/head)"),
    ("corrupt weights", "error: head_path={head}: cannot read {head}/model.safetensors: "),
    ("missing target", "error: cannot load target /nonexistent: target path /nonexistent: no such directory; pass "
                       "the target's HF model directory (config.json, weights, tokenizer)"),
])
def test_bad_input_is_one_line(tiny_target, head_dir, tmp_path, monkeypatch, capsys, case, message):
    """What train/ and serve/ do with bad input: one line naming the fix, exit status 2, no traceback."""
    from export.main import _hydra_main

    head_path, _ = head_dir(tiny_target, "eagle")
    args = [f"head_path={head_path}", "format=eagle", f"out={tmp_path / 'out'}"]
    if case == "missing head":
        args[0] = "head_path=/missing/head"
    elif case == "corrupt weights":
        (head_path / "model.safetensors").write_bytes(b"not a safetensors file")
    else:
        args.append("target_path=/nonexistent")
    monkeypatch.setattr(sys, "argv", ["export/main.py", *args])
    with pytest.raises(SystemExit) as exit_:
        _hydra_main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(message.format(head=head_path)), err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_subprocess(tiny_target, head_dir, tmp_path):
    """`python export/main.py ...` as a user types it (its own process: sys.path, Hydra, exit status)."""
    head_path, _ = head_dir(tiny_target, "medusa", num_steps=5)
    cmd = [sys.executable, str(ROOT / "export" / "main.py"), f"head_path={head_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run(cmd + ["format=medusa", "out=fd"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                        env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    written = {p.name for p in (tmp_path / "fd").iterdir()}
    assert {"medusa_lm_head.pt", "medusa_lm_head.safetensors", "config.json"} <= written
    bad = subprocess.run(cmd + ["format=sglang", "out=x"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == ("export refused: format 'sglang' cannot carry a medusa head; medusa "
                                                   "heads export to: vllm, medusa")


def test_copy_of_export_is_self_contained(exported, tmp_path):
    """Nothing in an export points back at the tmp dir it was validated in."""
    out, ctx, feats = exported("eagle3", "speculators", draft_vocab_size=64)
    moved = shutil.copytree(out, tmp_path / "moved")
    assert ".tmp" not in "".join(p.read_text() for p in moved.iterdir() if p.suffix in (".json", ".md", ".sh"))
    validate_export(moved, "speculators", ctx, feats)
