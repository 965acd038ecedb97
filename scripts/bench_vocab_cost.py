"""What reading logits out only at scored rows saves per training step: head_loss against the full-vocabulary loss.

    python scripts/bench_vocab_cost.py --families medusa eagle --reps 3

On the real target (SmolLM2 by default) and batches shaped like the default data (data=default: a chat prompt the
loss skips, then a sampled answer of up to --answer tokens it scores, --batch-size rows right-padded to the
longest): one training step (forward, loss, backward, clipping, AdamW) with the loss training used before
(``heads.losses.full_vocab_loss``: every position's [T, V] logits, the target's softmax once per step) and with
``head_loss``. Same head and optimizer for both, runs interleaved, best of --reps. Prints s/step and the ratio.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from heads import build_head
from heads.chat import render
from heads.losses import full_vocab_loss, head_loss
from heads.target import load_target
from train.data import collate, ids_example


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--families", nargs="+", default=["medusa", "eagle"])
    p.add_argument("--batch-size", type=int, default=4)  # data=default's batch_size
    p.add_argument("--answer", type=int, default=192)  # data=default's distill.max_new_tokens
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def default_like_batch(target, batch_size, answer, seed, prompts="train/seed_prompts.jsonl"):
    """Chat prompts from the repo's seed prompts (not scored) + answers of random length and tokens (scored)."""
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


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    target = load_target(args.target)
    batch = default_like_batch(target, args.batch_size, args.answer, args.seed)
    B, T = batch["input_ids"].shape
    scored = int(batch["loss_mask"].sum())
    print(f"{args.target}: batch [{B}, {T}], {scored} scored positions ({scored / (B * T):.0%}), "
          f"vocab {target.dims.vocab_size}, threads {torch.get_num_threads()}", flush=True)
    methods = {"full vocab (before)": full_vocab_loss, "scored rows (head_loss)": head_loss}
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
        print(f"{family}: " + ", ".join(f"{n} {best[n]:.2f} s/step ({best_cpu[n]:.2f} s CPU)" for n in best)
              + f"; before / after = {before / after:.2f}x wall, {cpu_before / cpu_after:.2f}x CPU", flush=True)


if __name__ == "__main__":
    main()
