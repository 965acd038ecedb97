"""The design card's command, `python train/main.py head=eagle target=llama2-7b`, down its whole path on a CPU, for
each big target, with a same-architecture stand-in for the weights (tests/standins.py; only `target.path=DIR`
and the sizes of a short run are added): config composition with the target's defaults, device and dtype choice,
the chat template, self-distillation, training, α, export to every format the family supports, and serve/'s
greedy output equal to the target's own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from export import formats_for
from export.main import export
from heads.target import load_target
from serve.main import serve
from tests.conftest import require_shared
from tests.standins import build_standin
from train import UserError
from train.main import run

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.shared, pytest.mark.slow]

# target -> (head, the prompt text the chat format must produce, the dtype the target's config loads)
CASES = {
    "llama2-7b": ("eagle", "[INST] Tell me about the sea. [/INST]", torch.bfloat16),
    "vicuna-7b": ("medusa", "questions. USER: Tell me about the sea. ASSISTANT:", torch.float16),
    "llama3.1-8b-instruct": ("eagle3", "<|start_header_id|>user<|end_header_id|>\n\nTell me about the sea.<|eot_id|>"
                             "<|start_header_id|>assistant<|end_header_id|>\n\n", torch.bfloat16),
}
TOPICS = ["the sea", "a red kite", "bread", "winter", "a small robot", "the moon", "trains", "a garden", "music",
          "rain", "stars", "coffee"]
SHORT = ["logger=none", "trainer.max_steps=3", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0",
         "trainer.checkpoint_every_n_steps=3", "optim.warmup_steps=1", "data.max_len=192", "data.batch_size=2",
         "data.eval_batch_size=4", "data.distill.max_new_tokens=10", "data.distill.samples_per_prompt=1"]


def prompts(path: Path, topics) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]}) + "\n"
                            for t in topics))
    return path


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    shared = require_shared("models", "stories260K-hf").parents[1]
    root = tmp_path_factory.mktemp("standins")
    return {name: build_standin(name, root / name, shared) for name in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_headline_command_whole_path(name, standins, tmp_path, monkeypatch):
    head, framed, dtype = CASES[name]
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    weights, out = standins[name], tmp_path / "run"
    overrides = [f"head={head}", f"target={name}", f"target.path={weights}", f"out_dir={out}",
                 f"data.train_files=[{prompts(tmp_path / 'train.jsonl', TOPICS[:8])}]",
                 f"data.eval_files=[{prompts(tmp_path / 'heldout.jsonl', TOPICS[8:])}]", *SHORT]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    assert (cfg.trainer.accelerator, cfg.trainer.precision) == ("auto", "auto")  # the hardware decides
    assert cfg.optim.lr == 1e-4 and cfg.data.distill.max_new_tokens == 10  # the target's defaults, then ours
    if head == "eagle3":
        assert (cfg.head.hparams.num_steps, cfg.head.hparams.draft_vocab_size) == (7, 32000)

    record = run(cfg)

    assert (cfg.trainer.accelerator, cfg.trainer.precision) == ("cpu", "32-true")  # no CUDA here
    target = load_target(name, str(weights), str(dtype).removeprefix("torch."), chat_format=cfg.target.chat_format)
    assert cfg.target.dtype == str(dtype).removeprefix("torch.")
    answers = [json.loads(line) for f in (tmp_path / "cache" / "data").glob("*-train-*.jsonl") for line in open(f)]
    assert len(answers) == 8 and all(a["token_ids"] for a in answers)  # self-distilled by the stand-in
    assert framed in target.tokenizer.decode(answers[0]["prompt_ids"][:60]) or any(
        framed in target.tokenizer.decode(a["prompt_ids"]) for a in answers)
    assert len(record["alpha"]) == cfg.head.hparams.num_steps and record["num_tokens"] > 0
    hits = [a * n for a, n in zip(record["alpha"], record["num_tokens_per_step"])]  # greedy α: whole matches
    assert record["temperature"] == 0.0 and all(abs(h - round(h)) < 1e-6 for h in hits), hits

    for fmt in formats_for(head):
        meta = json.loads((export({"head_path": str(out / "head"), "format": fmt, "out": str(tmp_path / fmt),
                                   "target_path": str(weights)})  # export's fp32 features, whatever trained
                           / "draftheads_export.json").read_text())
        assert meta["target"]["hidden_size"] == 64 and meta["target"]["num_layers"] == 8

    # serve/ in the target's dtype (the head cast to it), then in fp32 for exact greedy equality: a bf16/fp16
    # target verifying γ+1 tokens in one pass rounds differently from decoding them one by one, so near-ties in
    # a random model's logits can flip; equality token for token is a property of the algorithm at fp32.
    runs = {}
    for kind, extra in (("half", ["head_path=" + str(out), "gamma=3"]), ("vanilla", ["dtype=float32"]),
                       ("head", [f"head_path={out}", "gamma=3", "dtype=float32"])):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            scfg = compose("serve", [f"target={name}", f"target.path={weights}", "temperature=0", "max_new_tokens=16",
                                     "progress=false", "stop_at_eos=false",
                                     f"prompts={tmp_path / 'heldout.jsonl'}", *extra])
        bench = serve(scfg, tmp_path / f"serve-{kind}")
        expected = str(dtype).removeprefix("torch.") if kind == "half" else "float32"
        assert bench["settings"]["dtype"] == expected  # τ: one token a pass plus the drafts each pass kept
        assert bench["tau_measured"] == pytest.approx(1 + sum(bench["accepted_per_position"]) / bench["target_passes"])
        runs[kind] = [json.loads(x)["token_ids"] for x in (tmp_path / f"serve-{kind}" / "generations.jsonl").open()]
    assert all(len(t) == 16 for t in runs["half"])
    assert runs["head"] == runs["vanilla"] and all(len(t) == 16 for t in runs["head"])


def test_headline_cli_refuses_a_missing_template_in_one_line(standins, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTHEADS_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "train/main.py", "head=eagle", "target=llama2-7b", f"target.path={standins['llama2-7b']}",
           "target.chat_format=null", f"data.train_files=[{prompts(tmp_path / 'train.jsonl', TOPICS[:4])}]", *SHORT,
           f"hydra.run.dir={tmp_path / 'o'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "target.chat_format=" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("override, fix", [("trainer=ddp", "trainer.accelerator=cpu"),
                                           ("trainer.precision=16-mixed", "needs a CUDA device")])
def test_cuda_only_options_on_a_cpu_box(override, fix, standins, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA box runs these")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", ["head=eagle", "target=llama2-7b", f"target.path={standins['llama2-7b']}",
                                 f"out_dir={tmp_path}", override, *SHORT])
    with pytest.raises(UserError, match=fix):
        run(cfg)


def test_head_for_another_target_is_refused(standins, tmp_path, monkeypatch):
    """serve/ with a head trained on tiny-random against a Llama-2 stand-in: one line naming the mismatch."""
    from heads import build_head
    from heads.checkpoint import save_head
    from serve.main import UserError as ServeError

    tiny = load_target("tiny-random")
    head = build_head("eagle", tiny.dims, num_steps=2)
    save_head(head, tmp_path / "head", tiny.identity())
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        scfg = compose("serve", ["target=llama2-7b", f"target.path={standins['llama2-7b']}", "progress=false",
                                 f"head_path={tmp_path / 'head'}", "gamma=2",
                                 f"prompts={prompts(tmp_path / 'p.jsonl', TOPICS[:1])}"])
    with pytest.raises(ServeError, match=r"trained for target .tiny-random. \((hidden|vocab)_size="):
        serve(scfg, tmp_path / "serve")


def test_cpu_bf16_without_bf16_units_is_warned(monkeypatch, caplog):
    """bf16-mixed on a CPU that emulates bf16 trains slower than fp32: the run says so and names the fix."""
    from omegaconf import OmegaConf

    import train.trainer as job

    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "precision": "bf16-mixed"}, "target": {"dtype": "float32"}})
    for has_units, warned in ((False, True), (True, False)):
        monkeypatch.setattr(job, "cpu_has_bf16_units", lambda: has_units)
        caplog.clear()
        with caplog.at_level("WARNING", logger="train"):
            assert job.resolve_hardware(cfg) == ("cpu", "float32")
        assert ("emulated" in caplog.text and "trainer.precision=32-true" in caplog.text) == warned, caplog.text


def test_bf16_if_native_follows_the_cpu(monkeypatch):
    """The recipes' precision: bf16-mixed only on a CPU with bf16 units (emulated bf16 ran 8x slower than fp32);
    auto stays fp32 on every CPU."""
    from omegaconf import OmegaConf

    import train.trainer as job

    for has_units in (False, True):
        monkeypatch.setattr(job, "cpu_has_bf16_units", lambda: has_units)
        for asked, expected in (("bf16-if-native", "bf16-mixed" if has_units else "32-true"), ("auto", "32-true")):
            cfg = OmegaConf.create({"trainer": {"accelerator": "auto", "precision": asked},
                                    "target": {"dtype": "float32"}})
            job.resolve_hardware(cfg)
            assert cfg.trainer.precision == expected, (asked, has_units)
