"""τ predicted from held-out α (acceptance.json) is the τ serve/'s chain runner measures, at γ = 3, T = 0 and T = 1.

The job trains a Medusa head for a few seconds on stories260K's own samples, then ``train/main.py mode=eval``
answers the held-out openings greedily (T = 0) and by sampling (T = 1) and predicts τ by walking the chain over
those answers; serve/ decodes the same openings with the same head. At T = 0 both see the same text, so the walk's
rounds are the runner's target passes, exactly: the test counts them (the product of mean α, 0.4 % off here, fails
that), with the runner's tokens bounded by the text as the walk's are (a last round may run past max_new_tokens,
and bench.json's τ counts those tokens too). At T = 1 they see different samples of the same distribution.

Each opening is written twice in a row, so the held-out validation and test halves (heads/splits.py) hold the same
openings: acceptance.json's prediction (validation) is then about the very text serve/ decodes (every prompt).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPENINGS = ["Once upon a time", "One day, a little", "Tom and Lily", "The sun was", "There was a big dog",
            "Sam had a red", "Mom said", "The cat", "Lily wanted to", "The bird"]

pytestmark = [pytest.mark.shared, pytest.mark.slow]


def test_predicted_tau_is_the_runners(stories_target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": o, "id": f"{copy}-{i}"}) + "\n"
                               for i, o in enumerate(OPENINGS) for copy in "ab"))
    run = lambda *cmd: subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True, timeout=600, capture_output=True,
                                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    run("train/main.py", "target=stories260k", "data=tinystories", "head=medusa", "head.hparams.num_steps=3",
        "trainer.max_steps=150", "optim.lr=1e-2", "eval.extra_temperatures=[]", "logger=none",
        f"hydra.run.dir={tmp_path / 'train'}")  # a head trained by the job itself, on its own sampled stories
    run("train/main.py", "mode=eval", "target=stories260k", f"head_path={tmp_path / 'train' / 'head'}",
        f"data.eval_files=[{prompts}]", "data.distill.max_new_tokens=120", "eval.temperature=0.0",
        "eval.extra_temperatures=[1.0]", "logger=none", f"hydra.run.dir={tmp_path / 'eval'}")
    record = json.loads((tmp_path / "eval" / "acceptance.json").read_text())
    assert "greedy answers" in record["text_by_temperature"]["0.0"]
    assert "sampled at T=1" in record["text_by_temperature"]["1.0"]
    for t in ("0.0", "1.0"):
        run("serve/main.py", "target=stories260k", f"head_path={tmp_path / 'train' / 'head'}", f"prompts={prompts}",
            f"temperature={t}", "max_new_tokens=120", "gamma=3", "threads=1", "progress=false",
            f"hydra.run.dir={tmp_path / ('serve' + t)}")
        bench = json.loads((tmp_path / ("serve" + t) / "bench.json").read_text())
        answers = [json.loads(line)["token_ids"] for line in (tmp_path / ("serve" + t) / "generations.jsonl").open()]
        measured, predicted = bench["tau_measured"], record["tau_predicted_by_temperature"][t]["3"]
        text_tokens = sum(len(a) - 1 for a in answers)  # what rounds emit: each answer's first token is prefill's
        print(f"T={t}: τ predicted {predicted:.4f}, measured {measured:.4f} ({text_tokens / bench['target_passes']:.4f}"
              f" within the text), target passes {bench['target_passes']}, walk's rounds {text_tokens / predicted:.2f}"
              f", product of mean α {record['tau_product_of_alpha']['3'] if t == '0.0' else '-'}")
        assert len(answers) == 2 * len(OPENINGS) and 1.15 < measured < 3.7  # drafts something right, something wrong
        if t == "0.0":  # the same greedy text: the walk's expected rounds are the runner's passes, to the pass
            assert text_tokens / predicted == pytest.approx(bench["target_passes"], abs=0.5)
            # scripts/tau_on_generations.py walks serve/'s own text: the same α and rounds as mode=eval's answers
            run("scripts/tau_on_generations.py", str(tmp_path / ("serve" + t)))
            check = json.loads((tmp_path / ("serve" + t) / "tau_check.json").read_text())
            assert check["alpha"] == pytest.approx(record["alpha_by_temperature"][t], abs=1e-12)
            assert check["tokens"] == text_tokens and check["tau_measured"] == measured
            assert check["tokens"] / check["tau_predicted"] == pytest.approx(bench["target_passes"], abs=0.5)
        else:  # different samples: ~1 % apart with ~2,400 tokens each side
            assert predicted == pytest.approx(measured, rel=0.05)
