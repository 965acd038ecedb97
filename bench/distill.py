"""What self-distillation costs per answer token: train/distill.py's sample() on the records mode=distill answers.

    python -m bench distill --records 64 --reps 2
    python -m bench distill --records 256 --engines builtin vllm   # lever 7: distill.engine=vllm against the loop

The same seeded slice of ../shared/data/train that mode=distill answers (first turns), greedy, --reps times in one
process. Writes per run the answer tokens, wall tokens/s, tokens per CPU-second (steadier than wall on a shared
machine) and where the CPU went (prefill forwards, decode forwards, the rest: sampling, cache copies, Python), and
whether the repetitions wrote the same answers (greedy: they must). To compare two revisions, run it in a
`git worktree` of each, alternately, and compare tokens per CPU-second. ``--engines builtin vllm`` also answers
through vLLM (train/vllm_answers.py: its worker process is loaded once, before the timed runs, and its load time
reported apart); its CPU time is another process's, so compare the engines by wall tokens/s on an idle machine,
and how many of its greedy answers equal the built-in loop's.
"""
from __future__ import annotations

import glob
import time

from bench import common


def add_arguments(p) -> None:
    common.add_common(p, "target", "threads", "reps", "max-new-tokens", "out", threads=2, reps=1, max_new_tokens=192,
                      out="distill_out")
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--engines", nargs="+", default=["builtin"], choices=["builtin", "vllm"])


class ForwardClock:
    """CPU seconds spent in the model's forward, split into prefill (several tokens) and decode (one per row)."""

    def __init__(self, model):
        self.forward, self.spent = model.forward, {}
        model.forward = self

    def __call__(self, *args, **kwargs):
        kind = "prefill" if kwargs["input_ids"].shape[1] > 1 else "decode"
        c0 = time.process_time()
        out = self.forward(*args, **kwargs)
        self.spent[kind] = self.spent.get(kind, 0.0) + time.process_time() - c0
        return out


def main(args):
    from heads.target import load_target, shared_dir
    from train.distill import DistillConfig, prompt_ids, sample, stop_ids
    from train.regenerate import RegenConfig, select

    out = common.start(args, "distill")
    target = load_target(args.target)
    records = select(RegenConfig(files=sorted(glob.glob(str(shared_dir() / "data" / "train" / "*.jsonl"))),
                                 exclude_files=[str(shared_dir() / "data" / "eval" / "spec_bench" / "question.jsonl")],
                                 max_records=args.records))
    prompts = [prompt_ids(r, target.tokenizer) for r in records]
    cfg = DistillConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, batch_size=args.batch_size)
    clock = ForwardClock(target.model)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens (longest {max(map(len, prompts))}), "
          f"batch {args.batch_size}", flush=True)
    runs, answers, loads = [], {}, {}
    for engine in args.engines:
        answerer = None
        if engine == "vllm":
            from train.vllm_answers import VllmAnswers

            t0 = time.perf_counter()
            answerer = VllmAnswers(target, args.batch_size, target.dims.max_position_embeddings)
            loads[engine] = time.perf_counter() - t0
        try:
            for rep in range(args.reps):
                clock.spent = {}
                w0, c0 = time.perf_counter(), time.process_time()
                if answerer is None:
                    tokens, _ = sample(target.model, prompts, cfg, stop_ids(target), target.tokenizer.pad_token_id)
                else:
                    tokens = answerer.sample(prompts, cfg, stop_ids(target), "bench")
                wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                n = sum(map(len, tokens))
                answers.setdefault(engine, []).append(tokens)
                runs.append({"engine": engine, "rep": rep + 1, "answer_tokens": n, "wall_s": wall, "cpu_s": cpu,
                             "tokens_per_s": n / wall,
                             # vLLM's CPU time is its worker's, not this process's: no per-CPU-second figure
                             "tokens_per_cpu_s": n / cpu if answerer is None else None,
                             "cpu_s_by_part": {**clock.spent, "other": cpu - sum(clock.spent.values())}})
                print(f"{engine} run {rep + 1}/{args.reps}: {n} answer tokens, {n / wall:.1f} tok/s wall", flush=True)
        finally:
            if answerer is not None:
                answerer.close()
    differ = {e: sum(any(a[i] != got[0][i] for a in got[1:]) for i in range(len(prompts)))
              for e, got in answers.items()}
    first = answers[args.engines[0]][0]
    equal_to_first = {e: sum(got[0][i] == first[i] for i in range(len(prompts))) for e, got in answers.items()}
    report = common.record(target=args.target, prompts=len(prompts), prompt_tokens=sum(map(len, prompts)),
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, runs=runs,
                           engines=args.engines, load_s=loads, answers_differing_between_runs=differ,
                           answers_equal_to_first_engine=equal_to_first)
    common.write(out, "distill", report, markdown(report))


def markdown(report: dict) -> str:
    lines = common.header(report, f"Self-distillation on {report['target']}",
                          f"{report['prompts']} prompts ({report['prompt_tokens']} prompt tokens) · batch "
                          f"{report['batch_size']} · up to {report['max_new_tokens']} new tokens · greedy")
    lines += ["| engine | run | answer tokens | tokens/s (wall) | tokens per CPU-s | CPU-s prefill | CPU-s decode | "
              "CPU-s other |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["runs"]:
        part, per_cpu = r["cpu_s_by_part"], r["tokens_per_cpu_s"]
        cpu = ["—"] * 4 if per_cpu is None else [f"{per_cpu:.1f}", *(f"{part.get(k, 0):.0f}" for k in
                                                                   ("prefill", "decode", "other"))]
        lines.append(f"| {r['engine']} | {r['rep']} | {r['answer_tokens']} | {r['tokens_per_s']:.1f} | "
                     + " | ".join(cpu) + " |")
    first = report["engines"][0]
    lines += ["", f"Answers differing between runs (greedy: 0 expected): {report['answers_differing_between_runs']}; "
              f"answers equal to {first}'s: {report['answers_equal_to_first_engine']} of {report['prompts']}."]
    lines += [f"{e} loaded in {s:.0f} s (not in the runs)." for e, s in report["load_s"].items()] + [""]
    return "\n".join(lines)
