"""Greedy generation with vLLM (run with .venvs/vllm/bin/python), with and without speculative heads.

Files in, JSON out; imports nothing of draftheads. Prompts are token-id lists so every engine sees the same tokens.
A plan lists the runs; they share this process, so vLLM is imported once, and each engine core runs its worker
in-process (``uni`` executor): one process spawn per run instead of two. (A fully in-process engine,
VLLM_ENABLE_V1_MULTIPROCESSING=0, loads faster but generated 5-10x slower here: vLLM drops torch to one thread.)

    python vllm_generate.py --plan plan.json --prompts prompts.json --out result.json [--max-tokens 48]

plan.json: [{"name": "base", "model": TARGET_DIR},
            {"name": "eagle", "model": TARGET_DIR, "method": "eagle", "draft": DIR, "k": 3},
            {"name": "spec", "model": SPECULATORS_DIR}, ...]   # a speculators dir names its own verifier
result.json: {name: {"tokens": [[...], ...], "num_drafts", "num_draft_tokens", "num_accepted_tokens",
              "accepted_per_pos", "acceptance_per_pos", "method", "num_speculative_tokens", "load_s",
              "generate_s"} or {"error": "..."}}. Counters are vLLM's own (``llm.get_metrics()``), taken as the
difference across each run because the Prometheus registry is process-global.
"""
import argparse
import gc
import json
import os
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is more than these runs need


def spec_counters(llm) -> dict:
    out = {"accepted_per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [a + b for a, b in
                                       zip(list(m.values) + [0] * 99, out["accepted_per_pos"] + [0] * 99)][
                                      : max(len(m.values), len(out["accepted_per_pos"]))]
        elif m.name.startswith("vllm:spec_decode_") and hasattr(m, "value"):
            out[name] = out.get(name, 0) + m.value
    return out


def diff(after: dict, before: dict) -> dict:
    out = {k: v - before.get(k, 0) for k, v in after.items() if k != "accepted_per_pos"}
    prev = before.get("accepted_per_pos", [])
    out["accepted_per_pos"] = [v - (prev[i] if i < len(prev) else 0) for i, v in enumerate(after["accepted_per_pos"])]
    return out


def run(spec: dict, prompts, max_tokens: int, dtype: str) -> dict:
    from vllm import LLM, SamplingParams

    speculative_config = None
    if spec.get("method"):
        speculative_config = {"method": spec["method"], "model": spec["draft"],
                              "num_speculative_tokens": spec.get("k", 3)}
    t0 = time.time()
    llm = LLM(model=spec["model"], dtype=dtype, enforce_eager=True, max_model_len=1024, max_num_seqs=8, seed=0,
              speculative_config=speculative_config, disable_log_stats=False, distributed_executor_backend="uni")
    load_s = time.time() - t0
    before = spec_counters(llm)
    t0 = time.time()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    gen_s = time.time() - t0
    c = diff(spec_counters(llm), before)
    sc = llm.llm_engine.vllm_config.speculative_config
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "num_drafts": c.get("num_drafts", 0), "num_draft_tokens": c.get("num_draft_tokens", 0),
        "num_accepted_tokens": c.get("num_accepted_tokens", 0), "accepted_per_pos": c["accepted_per_pos"],
        "method": getattr(sc, "method", None), "num_speculative_tokens": getattr(sc, "num_speculative_tokens", 0),
        "load_s": round(load_s, 1), "generate_s": round(gen_s, 1),
    }
    if result["num_drafts"]:
        result["acceptance_per_pos"] = [a / result["num_drafts"] for a in result["accepted_per_pos"]]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(open(args.prompts))]
    results = {}
    for spec in json.load(open(args.plan)):
        try:
            results[spec["name"]] = run(spec, prompts, args.max_tokens, args.dtype)
        except Exception as e:  # one bad export must not hide the others' results
            results[spec["name"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        with open(args.out, "w") as f:  # after every run: a later crash keeps what finished
            json.dump(results, f)


if __name__ == "__main__":  # vLLM may spawn workers that re-import this file
    main()
