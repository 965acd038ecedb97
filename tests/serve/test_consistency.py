"""The runner's measured acceptance agrees with training's α on the same text.

A Medusa head is fitted for a few seconds on the target's own samples (heads/ API only), saved, and served at
T = 1 over TinyStories openings; ``train/main.py mode=eval`` then measures α on the runner's generations.jsonl as
held-out text. Both are Σ-over-positions estimates of the same quantity E[Σ_x min(p(x), q(x))] for draft step k
along the real text (heads.losses.alpha), so they must agree within sampling error. Position 1 is compared at
full strength; later positions only on what the runner reaches (rounds whose earlier drafts were all kept), which
selects easier contexts, so for them the runner's own Σ min(p, q) over the same rounds is the reference and
training's α a lower bound up to noise.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from heads import build_head
from heads.checkpoint import save_head
from heads.losses import head_loss

ROOT = Path(__file__).resolve().parents[2]
OPENINGS = ["Once upon a time", "One day, a little", "Tom and Lily", "The sun was", "There was a big dog",
            "Sam had a red", "Mom said", "The cat"]

pytestmark = [pytest.mark.shared, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def fit_medusa(target, steps=150):
    tok = target.tokenizer
    prompts = [tok(o).input_ids for o in OPENINGS]
    width = max(map(len, prompts))
    batch = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])  # left-padded openings
    torch.manual_seed(1234)  # training text: the target's samples from a seed of its own, never the served ones
    ids = target.model.generate(batch, attention_mask=(batch != tok.pad_token_id).long(), do_sample=True,
                                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=96, min_new_tokens=96,
                                pad_token_id=tok.pad_token_id)[:, width:]
    head = build_head("medusa", target.dims, num_steps=3)
    head.attach_target(target)
    head.init_from_target()
    feats = target.features(ids, layers=head.feature_layers)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, _ = head_loss(head, head(feats), feats, temperature=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def test_runner_acceptance_matches_train_eval(stories_target, tmp_path):
    if not (ROOT / "train" / "main.py").exists():
        pytest.skip("train/main.py is not in this checkout")
    head = fit_medusa(stories_target)
    save_head(head, tmp_path / "head", stories_target.identity())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": o, "id": f"{i}-{r}"}) + "\n"
                               for r in range(4) for i, o in enumerate(OPENINGS)))
    serve = [sys.executable, "serve/main.py", "target=stories260k", f"head_path={tmp_path / 'head'}",
             f"prompts={prompts}", "temperature=1.0", "max_new_tokens=120", "gamma=3", "stop_at_eos=false",
             "threads=1", "progress=false", f"hydra.run.dir={tmp_path / 'serve'}"]
    subprocess.run(serve, cwd=ROOT, check=True, timeout=600, capture_output=True)
    evaluate = [sys.executable, "train/main.py", "mode=eval", "target=stories260k", f"head_path={tmp_path / 'head'}",
                f"data.eval_files=[{tmp_path / 'serve' / 'generations.jsonl'}]", "eval.temperature=1.0",
                "eval.extra_temperatures=[]", "logger=none", f"hydra.run.dir={tmp_path / 'eval'}"]
    subprocess.run(evaluate, cwd=ROOT, check=True, timeout=600, capture_output=True)
    bench = json.loads((tmp_path / "serve" / "bench.json").read_text())
    trained_alpha = json.loads((tmp_path / "eval" / "acceptance.json").read_text())["alpha"]
    rate, own_alpha = bench["accept_rate_per_position"], bench["alpha_per_position"]
    reached = bench["reached_per_position"]
    print("runner rate", rate, "runner Σmin", own_alpha, "train eval α", trained_alpha, "reached", reached)

    sigma = lambda a, n: max(a * (1 - a), 0.01) ** 0.5 / n ** 0.5
    assert 0.1 < trained_alpha[0] < 0.9  # a head that is neither useless nor perfect: the test can fail
    # position 1: every round, the same quantity as training's α_1 on the same text
    assert abs(rate[0] - trained_alpha[0]) < 4 * sigma(trained_alpha[0], reached[0]) + 0.02
    for k in range(3):  # every position: the runner keeps drafts as often as its Σ min(p, q) says
        if reached[k] >= 50:
            assert abs(rate[k] - own_alpha[k]) < 4 * sigma(own_alpha[k], reached[k])
            assert rate[k] > trained_alpha[k] - 4 * sigma(trained_alpha[k], reached[k]) - 0.02
