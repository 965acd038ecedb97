"""What self-distillation costs per answer token: train/distill.py's sample() on the records mode=distill answers.

    python -m bench distill --records 64 --reps 2

The same seeded slice of ../shared/data/train that mode=distill answers (first turns), greedy, --reps times in one
process. Writes per run the answer tokens, wall tokens/s, tokens per CPU-second (steadier than wall on a shared
machine) and where the CPU went (prefill forwards, decode forwards, the rest: sampling, cache copies, Python), and
whether the repetitions wrote the same answers (greedy: they must). To compare two revisions, run it in a
`git worktree` of each, alternately, and compare tokens per CPU-second.
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
    runs, answers = [], []
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens (longest {max(map(len, prompts))}), "
          f"batch {args.batch_size}", flush=True)
    for rep in range(args.reps):
        clock.spent = {}
        w0, c0 = time.perf_counter(), time.process_time()
        tokens, _ = sample(target.model, prompts, cfg, stop_ids(target), target.tokenizer.pad_token_id)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        n = sum(map(len, tokens))
        answers.append(tokens)
        runs.append({"answer_tokens": n, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": n / wall,
                     "tokens_per_cpu_s": n / cpu, "cpu_s_by_part": {**clock.spent,
                                                                    "other": cpu - sum(clock.spent.values())}})
        print(f"run {rep + 1}/{args.reps}: {n} answer tokens, {n / wall:.1f} tok/s wall, {n / cpu:.1f} tok/CPU-s",
              flush=True)
    differ = sum(any(a[i] != answers[0][i] for a in answers[1:]) for i in range(len(prompts)))
    report = common.record(target=args.target, prompts=len(prompts), prompt_tokens=sum(map(len, prompts)),
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, runs=runs,
                           answers_differing_between_runs=differ)
    common.write(out, "distill", report, markdown(report))


def markdown(report: dict) -> str:
    lines = common.header(report, f"Self-distillation on {report['target']}",
                          f"{report['prompts']} prompts ({report['prompt_tokens']} prompt tokens) · batch "
                          f"{report['batch_size']} · up to {report['max_new_tokens']} new tokens · greedy")
    lines += ["| run | answer tokens | tokens/s (wall) | tokens per CPU-s | CPU-s prefill | CPU-s decode | "
              "CPU-s other |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(report["runs"], 1):
        part = r["cpu_s_by_part"]
        lines.append(f"| {i} | {r['answer_tokens']} | {r['tokens_per_s']:.1f} | {r['tokens_per_cpu_s']:.1f} | "
                     f"{part.get('prefill', 0):.0f} | {part.get('decode', 0):.0f} | {part['other']:.0f} |")
    lines += ["", f"Answers differing between runs: {report['answers_differing_between_runs']} of "
              f"{report['prompts']} (greedy: 0 expected).", ""]
    return "\n".join(lines)
