"""What the real-engine tests share: the engine venvs, the prompts, and briefly trained SmolLM2 heads.

The engines (vLLM, speculators, llama.cpp, the EAGLE and Medusa reference clients) live in their own venvs built
by scripts/engine_env.sh; the tests only talk to them through subprocesses and files (scripts/engines/*), so the
engines' pinned torch/transformers never meet ours. Missing engines skip the tests unless REQUIRE_ENGINES=1 (CI),
which turns the skip into a failure.

Fixture heads: the engine tests need heads that accept often enough for per-position acceptance to be meaningful,
trained in a minute on 2 CPU cores. ``train_fixture_head`` distils the head on the target's own greedy answers to
the test prompts (the test is whether an engine reproduces *our* drafts, not whether the head generalises), with
the loss restricted to the tokens that matter (every position's top-16 target tokens): that cuts the 49152-wide
lm_head matmul ~20x. Trained and frozen parameters are the usual ones; nothing here changes a head's format.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from heads import build_head
from heads.checkpoint import save_head
from heads.target import EngineEnvFailed, engine_venv, engine_venvs

ROOT = Path(__file__).resolve().parents[2]
# Outside the clone, so a fresh clone on the same machine (CI) reuses the engines; scripts/engine_env.sh agrees.
VENVS = engine_venvs()
ENGINE_SCRIPTS = ROOT / "scripts" / "engines"

# Training prompts (hand-written, not eval data). Chat-formatted for SmolLM2-Instruct.
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "List three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a prime number is to a child.",
    "Give me two tips for learning to cook.",
    "Why is the sky blue? Keep it short.",
]
MAX_NEW_TOKENS = 48
GAMMA = 3  # draft tokens per round in every engine test; heads are trained for this many steps
# Fixture heads beyond one per family: name -> (family, head hparams). EAGLE 3.1's norms, which vLLM reads.
VARIANTS = {"eagle3_31": ("eagle3", {"fc_norm": True, "norm_output": True})}


def skip_or_fail(reason: str):
    if os.environ.get("REQUIRE_ENGINES") == "1":
        pytest.fail(f"REQUIRE_ENGINES=1 but {reason}")
    pytest.skip(reason)


def engine_env(part: str) -> Path:
    """Create (or reuse) the venv for ``part`` (vllm, llamacpp, eagle_ref, medusa_ref) and return its directory."""
    t0 = time.time()
    try:
        venv = engine_venv(part, timeout=1800)
    except EngineEnvFailed as e:
        skip_or_fail(f"{e}:\n{e.stderr[-3000:]}")
    print(f"engine_env {part}: {time.time() - t0:.0f} s")
    return venv


def run_in(venv: Path, script: str, *args: str, timeout: int = 900, env: dict | None = None) -> str:
    """Run scripts/engines/<script> with the venv's python; fail with its stderr tail."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": "",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    cmd = [str(venv / "bin" / "python"), str(ENGINE_SCRIPTS / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc.stdout


def prompt_ids(target) -> list[list[int]]:
    tok = target.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for p in PROMPTS]


@torch.no_grad()
def greedy_answers(target, prompts: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """The target's greedy continuation of each prompt, stopping at EOS (a bare KV-cache loop: HF ``generate``
    costs several times more per token on CPU)."""
    from transformers import DynamicCache

    eos = target.model.config.eos_token_id
    out = []
    for ids in prompts:
        cache = DynamicCache()
        logits = target.model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
        answer = []
        while len(answer) < max_new_tokens:
            token = int(logits[0, -1].argmax())
            answer.append(token)
            if token == eos:
                break
            logits = target.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
        out.append(answer)
    return out


def _batch(prompts, answers, pad_id):
    seqs = [p + a for p, a in zip(prompts, answers)]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        mask[i, len(p) - 1 : len(s) - 1] = True  # anchors whose next token is an answer token
    return ids, attn, mask


def _sliced(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    out = nn.Linear(linear.in_features, len(rows), bias=False)
    out.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    return out


def new_head(family: str, target, token_counts: torch.Tensor | None = None, seed: int = 0,
             randomize: bool = False, num_steps: int = GAMMA, **extra_hp):
    """A fresh head as train/ would start it; ``randomize`` also scrambles Medusa's identity blocks."""
    torch.manual_seed(seed)
    hp = {"num_steps": num_steps, **extra_hp}
    if family == "eagle3":
        hp["draft_vocab_size"] = 4096
    head = build_head(family, target.dims, **hp)
    head.attach_target(target)
    if family == "eagle3":
        head.set_vocab_map(token_counts if token_counts is not None else torch.ones(target.dims.vocab_size))
    head.init_from_target()
    if randomize:
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "blocks" in name and p.dim() == 2:
                    p.normal_(0, 0.2)
    return head


def train_fixture_head(family: str, target, prompts, answers, steps: int = 150, lr: float = 2e-3, seed: int = 0,
                       num_steps: int = GAMMA, **hp):
    """Distil a head on the target's greedy answers (hard labels: the target's argmax), loss over a token subset."""
    ids, attn, mask = _batch(prompts, answers, target.tokenizer.pad_token_id)
    probe = new_head(family, target, torch.ones(target.dims.vocab_size), seed, num_steps=num_steps, **hp)
    feats = target.features(ids, mask, attn, layers=probe.feature_layers)
    labels = feats.target_logits.argmax(-1)  # [B, T]: the target's greedy next token at each position
    counts = torch.zeros(target.dims.vocab_size)
    counts.index_add_(0, feats.target_logits[mask].topk(16, -1).indices.flatten(), torch.ones(mask.sum() * 16))
    head = new_head(family, target, counts + torch.bincount(labels[mask], minlength=counts.numel()) * 100, seed,
                    num_steps=num_steps, **hp)
    # The vocabulary the loss runs over: the draft vocab for EAGLE-3, the top-16 tokens elsewhere.
    vocab = head.draft_to_target if family == "eagle3" else counts.nonzero().squeeze(1)
    index = torch.full((target.dims.vocab_size,), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    if family == "eagle":
        head.attach_modules(target.embed_tokens, _sliced(target.lm_head, vocab), target.final_norm)
    full_heads = None
    if family == "medusa":  # train the residual blocks; the lm_heads stay the target's (sliced for the loss)
        full_heads = head.lm_heads
        head.lm_heads = nn.ModuleList(_sliced(h, vocab) for h in full_heads)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        t0 = time.time()
        out = head(feats)
        loss = sum(out.aux.values()) if out.aux else 0.0
        for k, logits in enumerate(out.logits, start=1):
            y = index[labels[:, k:]][mask[:, k:]]  # the target's token at anchor t+k, in the loss vocab
            logits = logits[:, :-k][mask[:, k:]]
            keep = y >= 0
            loss = loss + F.cross_entropy(logits[keep].float(), y[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if os.environ.get("FIXTURE_DEBUG"):
            print(f"{family} step {step} loss {float(loss):.3f} {time.time() - t0:.2f}s", flush=True)
    if family == "eagle":
        head.attach_target(target)
    if full_heads is not None:
        head.lm_heads = full_heads
    return head.eval()


def save(head, target, path: Path) -> Path:
    return save_head(head, path, target.identity())


def fixture_heads(target, prompts, answers, families=("eagle", "eagle3", "medusa", "eagle3_31"),
                  steps: int = int(os.environ.get("FIXTURE_STEPS", 40))) -> dict:
    """{name: head dir} of trained fixture heads (a family, or a VARIANTS name) plus "eagle_random"/"eagle3_random"
    (fresh, untrained).

    40 steps: the EAGLE-1 loss is flat from ~step 35 (0.229 at 40, 0.214 at 80); α@1..3 on the answers ~0.97.

    Cached under VENVS/fixture-heads/<key>: the key hashes this file, the heads' module code (base, layers, the
    three families), the target identity and the training data, so a change to any of them retrains.
    """
    h = hashlib.sha256()
    for f in [Path(__file__), *(ROOT / "heads" / f"{m}.py" for m in ("base", "layers", "eagle", "eagle3", "medusa"))]:
        h.update(f.read_bytes())
    h.update(json.dumps([target.identity(), prompts, answers, list(families), steps]).encode())
    root = VENVS / "fixture-heads" / h.hexdigest()[:16]
    out = {}
    for name in families:
        path = root / name
        if not (path / "config.json").exists():
            t0 = time.time()
            family, hp = VARIANTS.get(name, (name, {}))
            save(train_fixture_head(family, target, prompts, answers, steps=steps, **hp), target, path)
            (root / f"{name}.train_s").write_text(f"{time.time() - t0:.0f}")
        out[name] = path
    for family in ("eagle", "eagle3"):
        path = root / f"{family}_random"
        if not (path / "config.json").exists():
            save(new_head(family, target, seed=1), target, path)
        out[f"{family}_random"] = path
    return out


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path
