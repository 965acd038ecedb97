"""The target answering prompts through vLLM (run with the vllm engine venv's python): `distill.engine=vllm`.

A long-lived worker: train/vllm_answers.py starts it once per `mode=distill` (or recipe) run, so vLLM loads the
target once, and sends one request per batch of prompts. Imports nothing of draftheads. Prompts are token-id lists
(the chat template is applied by the caller, as the built-in loop gets them), answers are token-id lists with the
stop token included when one was reached (what train/distill.py's sample() returns).

    python vllm_answer.py --model TARGET_DIR --max-num-seqs 32 --max-model-len 2048
    stdin, one JSON object per line:  {"prompts": [[ids]], "temperature": 0.7, "top_p": 0.95, "max_tokens": 192,
                                       "seeds": [s0, s1, ...], "stop_token_ids": [2]}
    stdout, one JSON object per line: {"tokens": [[ids]], "seconds": 12.3}   (the first line is {"ready": ...})
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB: 32 rows of ~1.5k tokens of SmolLM2 need ~2.2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")  # the target's dtype, as the built-in loop answers in it
    args = p.parse_args()
    # vLLM logs to stdout; the protocol owns it, so everything vLLM prints goes to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    # ``uni``: the worker runs inside the engine core process (one spawn); eager, since a compile pays off only on
    # much longer runs than a shard.
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, seed=0, distributed_executor_backend="uni")
    protocol.write(json.dumps({"ready": True, "load_s": round(time.time() - t0, 1)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        params = [SamplingParams(temperature=req["temperature"], top_p=req["top_p"] if req["temperature"] > 0 else 1.0,
                                 max_tokens=req["max_tokens"], seed=seed, stop_token_ids=req["stop_token_ids"],
                                 ignore_eos=False, skip_special_tokens=False)
                  for seed in req["seeds"]]
        t0 = time.time()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]], params, use_tqdm=False)
        protocol.write(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                                   "seconds": round(time.time() - t0, 3)}) + "\n")


if __name__ == "__main__":
    main()
