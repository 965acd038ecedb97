"""What reading logits out only at scored rows saves per training step: head_loss against the full-vocabulary loss.

    python -m bench vocab --families medusa eagle --reps 3

On the real target (SmolLM2 by default) and batches shaped like the default data (data=default: a chat prompt the
loss skips, then a sampled answer of up to --answer tokens it scores, --batch-size rows right-padded to the
longest): one training step (forward, loss, backward, clipping, AdamW) with the loss training used before
(``heads.losses.full_vocab_loss``: every position's [T, V] logits, the target's softmax once per step) and with
``head_loss``. Same head and optimizer for both, runs interleaved, best of --reps. Writes s/step (wall and CPU)
and the ratio to OUT/vocab.json and OUT/vocab.md.
"""
from __future__ import annotations

import json
import time

import torch

from bench import common


def add_arguments(p) -> None:
    common.add_common(p, "target", "threads", "out", out="vocab_out")
    p.add_argument("--families", nargs="+", default=["medusa", "eagle"])
    p.add_argument("--batch-size", type=int, default=4)  # data=default's batch_size
    p.add_argument("--answer", type=int, default=192)  # data=default's distill.max_new_tokens
    p.add_argument("--reps", type=int, default=3, help="repetitions per method; the fastest counts")
    p.add_argument("--seed", type=int, default=0)


def default_like_batch(target, batch_size, answer, seed, prompts=common.ROOT / "train" / "seed_prompts.jsonl"):
    """Chat prompts from the repo's seed prompts (not scored) + answers of random length and tokens (scored)."""
    from heads.chat import render
    from train.data import collate, ids_example

    g = torch.Generator().manual_seed(seed)
    with open(prompts) as f:
        records = [json.loads(line) for line in f][:batch_size]
    examples = []
    for r in records:
        prompt = target.tokenizer(render(target.tokenizer, r["messages"], add_generation_prompt=True),
                                  add_special_tokens=False).input_ids
        n = int(torch.randint(answer * 2 // 3, answer + 1, (1,), generator=g))
        examples.append(ids_example(prompt, torch.randint(0, target.dims.vocab_size, (n,), generator=g).tolist(), 512))
    return collate(examples, target.tokenizer.pad_token_id)


def train_step(head, opt, feats, loss_fn, decay):
    opt.zero_grad(set_to_none=True)
    out = head(feats)
    loss = loss_fn(head, out, feats, "soft_ce", decay)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def main(args):
    from heads import build_head
    from heads.losses import full_vocab_loss, head_loss
    from heads.target import load_target

    out = common.start(args, "vocab")
    torch.manual_seed(args.seed)
    target = load_target(args.target)
    batch = default_like_batch(target, args.batch_size, args.answer, args.seed)
    B, T = batch["input_ids"].shape
    scored = int(batch["loss_mask"].sum())
    print(f"{args.target}: batch [{B}, {T}], {scored} scored positions ({scored / (B * T):.0%}), "
          f"vocab {target.dims.vocab_size}, threads {torch.get_num_threads()}", flush=True)
    methods = {"full vocab (before)": full_vocab_loss, "scored rows (head_loss)": head_loss}
    results = []
    for family in args.families:
        head = build_head(family, target.dims)
        head.attach_target(target)
        head.init_from_target()
        feats = target.features(batch["input_ids"], batch["loss_mask"], batch["attention_mask"],
                                layers=head.feature_layers)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
        best = {name: float("inf") for name in methods}
        best_cpu = dict(best)
        for fn in methods.values():
            train_step(head, opt, feats, fn, 0.8)  # warm-up
        for _ in range(args.reps):
            for name, fn in methods.items():
                t0, c0 = time.perf_counter(), time.process_time()
                train_step(head, opt, feats, fn, 0.8)
                # CPU seconds too: on a shared machine they move far less with the load than wall time does
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                best[name] = min(best[name], wall)
                best_cpu[name] = min(best_cpu[name], cpu)
                print(f"  {family} {name}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
        (before, after), (cpu_before, cpu_after) = best.values(), best_cpu.values()
        results.append({"family": family, "seconds_per_step": best, "cpu_seconds_per_step": best_cpu,
                        "before_over_after_wall": before / after, "before_over_after_cpu": cpu_before / cpu_after})
    report = common.record(target=args.target, batch=[B, T], scored_positions=scored, reps=args.reps,
                           results=results)
    common.write(out, "vocab", report, markdown(report))


def markdown(report: dict) -> str:
    B, T = report["batch"]
    lines = common.header(report, f"A training step's loss vocabulary on {report['target']}",
                          f"batch [{B}, {T}] · {report['scored_positions']} scored positions · best of "
                          f"{report['reps']}")
    lines += ["| family | method | s/step (wall) | s/step (CPU) |", "|---|---|---:|---:|"]
    for r in report["results"]:
        for name, wall in r["seconds_per_step"].items():
            lines.append(f"| {r['family']} | {name} | {wall:.2f} | {r['cpu_seconds_per_step'][name]:.2f} |")
        lines.append(f"| {r['family']} | before ÷ after | {r['before_over_after_wall']:.2f}× | "
                     f"{r['before_over_after_cpu']:.2f}× |")
    return "\n".join(lines + [""])
