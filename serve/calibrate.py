"""What a whole decode round costs on this machine, and gamma=auto's choice with it.

serve/auto.py predicts a setting's cost from its target pass and draft steps; here whole rounds of the real decode
loop are timed, and the excess per kind of round (plain, chain, tree) is added to every setting of that kind before
the choice. It lives apart from serve/auto.py because it runs serve/generate.py's loop, which imports auto.
"""
from __future__ import annotations

import time

import torch

from serve import auto
from serve.generate import Decoder, Sampling, accept, draft, prefill, verify
from serve.setting import Costs, Setting
from serve.tree import build_tree


@torch.inference_mode()
def time_rounds(model, head, sampling: Sampling, settings: list[Setting], context: int = 256, rounds: int = 4,
                blocks: int = 3) -> list[float]:
    """Seconds of one whole decode round (draft, verify, accept) per setting, the fastest of rounds × blocks.

    serve.auto.measure_costs times the target pass and the draft step alone. The rest of a round (the drafting loop's
    Python, verify's sampling and host sync, the commit, a tree's mask and its shape sync) is not small next to a small
    target's pass: on the compiled SmolLM2 runner an 8-node tree ran ~2.35 plain rounds against 1.84 predicted, and
    gamma=auto served it at 0.65x plain (docs/results/serving-and-adaptive.md). Settings take turns, block by block,
    each from a fresh prefill of the same random ``context`` tokens (they share the target's cache); a block's first
    round is a warm-up. Random text is rarely accepted, so rounds keep ~1 token: the cost of the round, not of its luck.
    """
    device = model.device
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    decoders = [Decoder(model, head if s.kind != "plain" else None, sampling, gamma=s.gamma, tree=build_tree(s, device))
                for s in settings]
    best = [float("inf")] * len(settings)
    for _ in range(blocks):
        for i, dec in enumerate(decoders):
            prefill(dec, prompt.to(device), (rounds + 1) * (dec.draft_width + 1))
            for j in range(rounds + 1):
                t0 = time.perf_counter()
                verdict, hidden = verify(dec, draft(dec))
                accept(dec, verdict, hidden)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if j:
                    best[i] = min(best[i], time.perf_counter() - t0)
    return best


def choose(model, head, sampling: Sampling, alphas: list[float], costs: Costs, tree: str | None,
           tau_chain: dict | None = None, ranks: list | None = None) -> dict:
    """auto.choose with each kind's round excess: plain decoding and the best setting of each drafting kind by
    the passes alone are timed whole, and the table is scored again. The record says what was timed and what the
    passes alone would have chosen."""
    family, steps = head.family, head.max_draft_steps
    passes_only = auto.choose(family, steps, alphas, costs, tree, tau_chain, ranks=ranks)
    timed = auto.to_time(passes_only["table"], auto.candidates(family, steps, alphas, tree))
    seconds = time_rounds(model, head, sampling, timed)
    excess = auto.round_excess(timed, seconds, costs, alphas)
    record = auto.choose(family, steps, alphas, costs, tree, tau_chain, excess, ranks)
    record.update(round_excess=excess, rounds_timed_s={s.describe(): t for s, t in zip(timed, seconds)},
                  passes_only_choice={"setting": passes_only["choice"].describe(), **passes_only["predicted"]})
    return record
