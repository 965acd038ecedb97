"""train(cfg) end to end on tiny-random: every head trains, outputs, eval round trip, resume, bad input."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from heads import HEADS
from train import UserError
from train.main import run as train
from train.module import DraftModule

ROOT = Path(__file__).resolve().parents[2]


def logged(out: Path, name: str) -> list[float]:
    rows = list(csv.DictReader(open(next(out.glob("csv/*/metrics.csv")))))
    return [float(r[name]) for r in rows if r.get(name)]


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_trains(name, fast_cfg, tmp_path):
    out = tmp_path / name
    # AdamW for all: the head's wiring is under test, not the optimizer (Muon has its own test below; in 12 steps on
    # this toy target it lowers EAGLE-1's loss by only ~7%, though it wins in the SmolLM2 recipe)
    cfg = fast_cfg(f"head={name}", "head.loss.kind=kl", "logger=csv", "trainer.max_steps=12", "optim.lr=3e-3",
                   "optim.name=adamw", out=out)
    record = train(cfg)
    losses = logged(out, "train/loss")
    assert len(losses) == 12 and all(map(lambda x: x == x, losses))
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses  # KL can reach 0: a falling loss is real learning
    assert record["head"] == name and len(record["alpha"]) == cfg.head.hparams.num_steps


def test_muon_trains_a_head_under_lightning(fast_cfg, tmp_path):
    """optim.name=muon: Lightning steps Muon and AdamW as one optimizer (clipping, schedule, checkpoint)."""
    out = tmp_path / "muon"
    train(fast_cfg("head=eagle3", "optim.name=muon", "head.loss.kind=kl", "logger=csv", "trainer.max_steps=12",
                   out=out))
    losses = logged(out, "train/loss")
    assert len(losses) == 12 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


@pytest.mark.parametrize("cache", ["true", "false"])
def test_training_alpha_on_logged_steps_only_and_the_loss_unchanged(cache, fast_cfg, tmp_path):
    """train/alpha@k is computed on the steps Lightning logs; the steps between compute the target's logits only at
    the draft vocabulary's columns. The logged losses must be those of a run computing α every step."""
    common = ("head=eagle3", "head.hparams.draft_vocab_size=100", "logger=csv", "trainer.max_steps=9", "seed=3",
              f"data.cache_features={cache}")
    train(fast_cfg(*common, out=tmp_path / "every"))  # log_every_n_steps=1: full-vocabulary logits every step
    train(fast_cfg(*common, "trainer.log_every_n_steps=3", out=tmp_path / "third"))
    every = {int(r["step"]): r for r in csv.DictReader(open(next((tmp_path / "every").glob("csv/*/metrics.csv"))))
             if r.get("train/loss")}
    third = [r for r in csv.DictReader(open(next((tmp_path / "third").glob("csv/*/metrics.csv"))))
             if r.get("train/loss")]
    assert sorted(every) == list(range(9)) and [int(r["step"]) for r in third] == [2, 5, 8]
    for r in third:
        ref = every[int(r["step"])]
        assert float(r["train/loss"]) == pytest.approx(float(ref["train/loss"]), rel=1e-4)
        assert float(r["train/alpha@1"]) == pytest.approx(float(ref["train/alpha@1"]), abs=1e-6)


def test_outputs_and_acceptance_json(fast_cfg, tmp_path):
    out = tmp_path / "run"
    record = train(fast_cfg("head=eagle3", "head.hparams.num_steps=3", "logger=wandb", "eval.extra_temperatures=[1.0]",
                            out=out))
    saved = json.loads((out / "acceptance.json").read_text())
    assert saved == json.loads(json.dumps(record))
    for key in ("head", "target", "data", "temperature", "alpha", "tau_predicted", "num_tokens", "alpha_untrained"):
        assert key in saved, key
    assert saved["target"] == "tiny-random" and saved["temperature"] == 0.0 and len(saved["alpha"]) == 3
    assert set(saved["tau_predicted"]) == {"1", "2", "3"} and saved["num_tokens"] > 100
    assert saved["tau_product_of_alpha"]["1"] == pytest.approx(1 + saved["alpha"][0])
    assert saved["alpha_chain"][0] == pytest.approx(saved["alpha"][0])  # step 1 is not conditioned on anything
    taus = [saved["tau_predicted"][g] for g in ("1", "2", "3")]
    assert 1.0 < taus[0] <= taus[1] <= taus[2] <= 1 + sum(saved["alpha"])  # α > 0 (below): rounds emit > 1 token
    assert set(saved["text_by_temperature"]) == {"0.0", "1.0"}
    # rank 0's hit rate reads the same logits as α (acceptance_grid): equal by bookkeeping. What α counts is checked
    # against a loop over anchors in test_greedy_alpha_is_a_count_over_anchors
    ranks = saved["alpha_rank_by_temperature"]
    assert set(ranks) == {"0.0"} and [row[0] for row in ranks["0.0"]] == pytest.approx(saved["alpha"])
    assert all(sum(row) <= 1 + 1e-9 and row[1] > 0 for row in ranks["0.0"]), ranks  # distinct ranks, siblings hit
    # training reached the measured head: it beats its own untrained start at every position and temperature
    for t, alphas in saved["alpha_by_temperature"].items():
        untrained = saved["alpha_untrained_by_temperature"][t]
        assert all(a > u for a, u in zip(alphas, untrained, strict=True)), (t, alphas, untrained)
    assert set(saved["alpha_by_temperature"]) == {"0.0", "1.0"}
    assert (out / "alpha.png").stat().st_size > 1000 and (out / "checkpoints" / "last.ckpt").exists()
    assert list((out / "wandb").glob("offline-run-*")), "the default logger writes an offline W&B run"
    config = json.loads((out / "head" / "config.json").read_text())
    assert config["family"] == "eagle3" and config["target"]["name"] == "tiny-random"
    weights = load_file(str(out / "head" / "model.safetensors"))
    # only the head's own tensors (its draft-vocab lm_head, not the target's embeddings or decoder)
    assert {k.split(".")[0] for k in weights} == {"fc", "midlayer", "norm", "lm_head", "d2t", "t2d"}
    assert weights["lm_head.weight"].shape[0] == config["hparams"]["draft_vocab_size"]


def test_target_never_trained_or_checkpointed(fast_cfg, tmp_path, tiny_target):
    out = tmp_path / "run"
    before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    train(fast_cfg("head=eagle", "optim.name=muon", out=out))  # Muon's split state: the harder one to get right
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(k.startswith("head.") for k in ckpt["state_dict"])
    n_head = sum(v.numel() for k, v in ckpt["state_dict"].items())
    opt = ckpt["optimizer_states"][0]  # Muon's momentum on the hidden matrices, AdamW's exp_avg on the rest
    n_opt = (sum(s["momentum_buffer"].numel() for s in opt["muon"]["state"].values())
             + sum(s["exp_avg"].numel() for s in opt["adamw"]["state"].values()))
    assert n_opt == n_head  # optimizer state for the head's parameters only
    from heads.target import load_target

    fresh = load_target("tiny-random")  # train() loads its own copy; the seeded target is bit-identical
    for k, v in fresh.model.state_dict().items():
        torch.testing.assert_close(v, before[k])


def test_eval_mode_round_trip(fast_cfg, tmp_path, chat_files, tiny_target):
    out = tmp_path / "run"
    trained = train(fast_cfg("head=medusa", out=out))
    again = train(fast_cfg("mode=eval", f"head_path={out / 'head'}", f"data.eval_files=[{chat_files[1]}]",
                           out=tmp_path / "eval"))
    assert again["alpha"] == pytest.approx(trained["alpha"], abs=1e-9)
    assert again["num_tokens"] == trained["num_tokens"] and "alpha_untrained" not in again
    assert (tmp_path / "eval" / "acceptance.json").exists()

    # serve/ writes OUT/generations.jsonl (prompt_ids + token_ids): the same tokens give the same α
    from train.data import chat_example
    from heads.records import read_sources

    rows = []
    for record in read_sources([str(chat_files[1])]):
        ex = chat_example(record.messages, tiny_target.tokenizer, 512)
        start = int(ex.loss_mask.nonzero()[0]) + 1  # the first answer token
        rows.append({"prompt_ids": ex.input_ids[:start].tolist(), "token_ids": ex.input_ids[start:].tolist()})
    generations = tmp_path / "generations.jsonl"
    generations.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_serve = train(fast_cfg("mode=eval", f"head_path={out / 'head'}", f"data.eval_files=[{generations}]",
                                out=tmp_path / "eval_generations"))
    assert from_serve["alpha"] == pytest.approx(trained["alpha"], abs=1e-9)
    assert from_serve["num_tokens"] == trained["num_tokens"]


SAMPLED_MEDUSA = ("head=medusa", "head.hparams.num_steps=2", "head.hparams.loss_vocab_size=128",
                  "head.hparams.loss_vocab_sampled=64")


@pytest.mark.parametrize("head", [("head=eagle",), SAMPLED_MEDUSA, ("head=eagle3", "optim.name=muon")])
def test_resume_reproduces_uninterrupted_run(head, fast_cfg, write_chat, tmp_path, monkeypatch):
    """Crash after step 5, resume from the step-4 checkpoint: the final head equals an uninterrupted run's.

    24 records / batch 4 = 6 batches per epoch, 8 steps: the resume lands mid-epoch and the run crosses an epoch,
    so optimizer, scheduler and data position all have to come back right; with a sampled loss vocabulary, so do
    each step's drawn tokens (Medusa's trained lm_heads only learn the rows drawn).
    """
    small = write_chat(tmp_path / "small.jsonl", n=24)
    common = (*head, f"data.train_files=[{small}]", "trainer.checkpoint_every_n_steps=4")
    train(fast_cfg(*common, out=tmp_path / "straight"))

    calls = {"n": 0}
    original = DraftModule.training_step

    def crashing(self, batch, batch_idx):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("simulated crash")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(DraftModule, "training_step", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(fast_cfg(*common, out=tmp_path / "resumed"))
    monkeypatch.setattr(DraftModule, "training_step", original)
    record = train(fast_cfg(*common, "resume=true", out=tmp_path / "resumed"))
    assert record["train_steps"] == 8
    a = load_file(str(tmp_path / "straight" / "head" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "head" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_head_that_does_not_fit_target(fast_cfg, tmp_path):
    with pytest.raises(UserError, match=r"does not fit target tiny-random.*aux layer.*head.hparams"):
        train(fast_cfg("head=eagle3", "head.hparams.aux_layers=[2,4,40]"))


def test_unreadable_checkpoint(fast_cfg, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read checkpoint .*last.ckpt.*ckpt_path="):
        train(fast_cfg("resume=true", out=out))
    with pytest.raises(UserError, match="no checkpoint at"):
        train(fast_cfg(f"ckpt_path={tmp_path / 'missing.ckpt'}", out=out))


def test_eval_refuses_head_of_another_target(fast_cfg, tmp_path):
    out = tmp_path / "run"
    train(fast_cfg("head=mtp", out=out))
    config = json.loads((out / "head" / "config.json").read_text())
    config["target"]["hidden_size"] = 4096
    (out / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="hidden_size.*use the matching target"):
        train(fast_cfg("mode=eval", f"head_path={out / 'head'}", out=tmp_path / "eval"))
    (out / "head" / "model.safetensors").write_bytes(b"garbage")
    config["target"]["hidden_size"] = 64
    (out / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="cannot read .*model.safetensors"):
        train(fast_cfg("mode=eval", f"head_path={out / 'head'}", out=tmp_path / "eval"))


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "train/main.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_error_is_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = run_cli("target=tiny-random", "logger=none", f"data.train_files=[{empty}]", f"hydra.run.dir={tmp_path}/o")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(empty) in errors[0] and "Traceback" not in proc.stderr


def test_llama2_config_resolves_without_download():
    """The design card's line: with no GPU and no weights the config still composes (nothing is loaded)."""
    proc = run_cli("head=eagle", "target=llama2-7b", "--cfg", "job", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "name: meta-llama/Llama-2-7b-chat-hf" in proc.stdout and "name: eagle" in proc.stdout
    assert "feature_loss_weight" in proc.stdout and "chat_format: llama-2" in proc.stdout
    assert "max_steps: 1000" in proc.stdout and "accelerator: auto" in proc.stdout  # the target's defaults


def held_out_batches(target, seed=0, B=3, T=40):
    """Two batches of random text with two answer spans a row, one row right-padded."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(2):
        ids = torch.randint(0, target.dims.vocab_size, (B, T), generator=g)
        attn = torch.ones(B, T, dtype=torch.long)
        attn[1, 30 + i:] = 0
        loss = torch.zeros(B, T, dtype=torch.bool)
        loss[:, 8:20] = True
        loss[:, 24:T - 1] = True
        loss &= attn.bool() & attn.roll(-1, 1).bool()  # no anchor whose next token is padding
        batches.append({"input_ids": ids, "attention_mask": attn, "loss_mask": loss})
    return batches


# family -> (std of the target's weights, 0: tiny-random's own; std of the head's perturbation; how much louder the
# target makes tokens 0-7): a head that is right at some anchors of every step and wrong at others. EAGLE-3's random
# layers agree with a target of near-equal logits only on near-ties, which round differently per CPU (hits on the AMX
# Xeons CI ran on, none in 143 on an AVX512 Xeon without AMX); eight louder tokens give ~20% hits on clear margins.
ALPHA_CASES = {"medusa": (0.05, 0.0, 1.0), "eagle3": (0.05, 0.0, 4.0)}


@pytest.mark.parametrize("family", sorted(ALPHA_CASES))
def test_greedy_alpha_is_a_count_over_anchors(family):
    """acceptance.json's greedy α (train.acceptance.measure) against a loop over anchors written out here: step k
    at anchor t is kept when the head's top token at t is the target's argmax at t + k, counted where the token
    after t + k is trained. A step read at the wrong anchor, a mask off by one or counts pooled the wrong way miss
    it; rank 0's hit rate (acceptance_grid's other reading of the same logits) must be that count too."""
    from heads.target import load_target
    from serve.model import Transformer
    from tests.serve.conftest import perturbed_head
    from train.acceptance import measure

    target_std, head_std, loud = ALPHA_CASES[family]
    target = load_target("tiny-random")
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in target.model.parameters():
            if target_std and p.dim() == 2:
                p.normal_(0, target_std, generator=g)
        target.model.lm_head.weight[:8] *= loud
    torch.manual_seed(0)  # the head's layers that init_from_target leaves random
    head = perturbed_head(family, target, Transformer.from_hf(target.model), std=head_std)
    batches = held_out_batches(target)
    got = measure({"h": head}, target, batches, [0.0])["h"][0.0]
    K = head.num_steps
    hits, counts = [0] * K, [0] * K
    with torch.no_grad():
        for b in batches:
            feats = target.features(b["input_ids"], b["loss_mask"], b["attention_mask"], layers=head.feature_layers)
            logits = head(feats).logits  # K x [B, T, V_draft]: step k at anchor t predicts x_{t+1+k}
            B, T = b["input_ids"].shape
            for k in range(1, K + 1):
                for r in range(B):
                    for t in range(T - k):
                        if b["loss_mask"][r, t + k]:
                            counts[k - 1] += 1
                            draft = int(head.to_target_vocab(logits[k - 1][r, t][None]).argmax())
                            hits[k - 1] += draft == int(feats.target_logits[r, t + k].argmax())
    assert all(0 < h < c for h, c in zip(hits, counts)), (hits, counts)  # hits and misses: the count can tell
    assert got["num_tokens"] == counts
    assert got["alpha"] == pytest.approx([h / c for h, c in zip(hits, counts)], abs=1e-12)
    assert [row[0] for row in got["alpha_rank"]] == pytest.approx(got["alpha"], abs=1e-12)
