"""τ predicted by walking the chain over held-out text equals a brute-force simulation of the runner; α per category
adds up to the overall α."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from train.acceptance import Tally, chain_rounds, decoding


def grid_and_mask(seed: int, B=3, T=40, K=4, binary=True):
    rng = np.random.default_rng(seed)
    grid = (rng.random((B, T, K)) < 0.6).astype(float) if binary else rng.random((B, T, K))
    mask = np.zeros((B, T), bool)
    mask[:, 5:22] = True  # two answer spans per row (a multi-turn record), prompts before each
    mask[:, 27:38] = True
    mask[1, 30:] = False  # rows of different lengths
    for k in range(1, K + 1):  # step k at anchor t is only measured when the token after t + k is trained
        grid[:, :, k - 1] *= np.concatenate([mask[:, k:], np.zeros((B, k), bool)], 1)
    return grid, mask


def simulate(grid, mask, gamma, rng=None) -> float:
    """A runner over the text: a round at anchor t emits 1 + the drafts accepted in a row, then moves on; the
    first token of a span comes from prefill and its last anchor has nothing left to emit."""
    rounds = 0
    active = decoding(mask)
    for b in range(grid.shape[0]):
        t = 0
        while t < mask.shape[1]:
            if not active[b, t]:
                t += 1
                continue
            run = 0
            while run < gamma and (grid[b, t, run] == 1 if rng is None else rng.random() < grid[b, t, run]):
                run += 1
            rounds += 1
            t += 1 + run
    return rounds


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_greedy_walk_is_the_runner_exactly(seed, gamma):
    grid, mask = grid_and_mask(seed)
    assert chain_rounds(grid, mask, gamma) == pytest.approx(simulate(grid, mask, gamma))


def test_sampled_walk_is_the_expected_runner():
    grid, mask = grid_and_mask(3, binary=False)
    rng = np.random.default_rng(0)
    runs = [simulate(grid, mask, 3, rng) for _ in range(3000)]
    assert chain_rounds(grid, mask, 3) == pytest.approx(np.mean(runs), abs=4 * np.std(runs) / np.sqrt(len(runs)))


def test_tally_alpha_and_chain_against_brute_force():
    grid, mask = grid_and_mask(4)
    tally = Tally(4)
    tally.add(torch.from_numpy(grid), torch.from_numpy(mask))
    s = tally.summary()
    T = mask.shape[1]
    for k in range(1, 5):
        valid = mask[:, k:]  # anchor t counts for step k when the token after t + k is trained
        assert s["alpha"][k - 1] == pytest.approx(grid[:, :T - k, k - 1][valid].mean())
        reached = np.prod(grid[..., :k - 1], -1)[mask].sum() if k > 1 else mask.sum()
        assert s["alpha_chain"][k - 1] == pytest.approx(np.prod(grid[..., :k], -1)[mask].sum() / reached)
    assert s["tau_predicted"][3] == pytest.approx(decoding(mask).sum() / simulate(grid, mask, 3))


def test_alpha_per_category_adds_up(fast_cfg, tmp_path):
    from train.main import run

    heldout = tmp_path / "cats.jsonl"
    with open(heldout, "w") as f:
        for i in range(8):
            f.write(json.dumps({"category": ["writing", "math"][i % 2], "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"An answer about {i}, " * (2 + i)}]}) + "\n")
    record = run(fast_cfg("head=mtp", "trainer.max_steps=2", f"data.eval_files=[{heldout}]"))
    alpha, tokens = record["alpha_by_category"], record["num_tokens_by_category"]
    assert set(alpha) == {"writing", "math"} and sum(tokens.values()) == record["num_tokens"]
    weighted = sum(alpha[c][0] * tokens[c] for c in alpha) / record["num_tokens"]
    assert weighted == pytest.approx(record["alpha"][0])
    assert record["text_by_temperature"]["0.0"] == "dataset text of 8 held-out records"


@pytest.mark.parametrize("name", ["eagle3", "medusa"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_grid_on_draft_columns_equals_alpha_over_the_target_vocabulary(name, temperature, top_k, top_p,
                                                                       tiny_target):
    """acceptance_grid reads the draft's logits on its own (reduced) vocabulary; alpha_sums scatters them to the
    target's and compares there. Per step the sums agree, and a greedy rank's hits are target-vocabulary top-k's."""
    from heads.base import HeadOutput
    from heads.losses import alpha_sums, scored_logits
    from train.acceptance import RANKS, acceptance_grid

    from tests.heads.test_losses import CopyHead, random_head

    head = random_head(name, tiny_target)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny_target.dims.vocab_size, (3, 40), generator=g)
    feats = tiny_target.features(ids, torch.rand(3, 40, generator=g) > 0.3, layers=head.feature_layers)
    if name == "eagle3":  # a draft vocabulary holding most of the target's greedy tokens, so that some are accepted
        greedy = feats.target_logits.argmax(-1).flatten()
        head.set_vocab_map(torch.bincount(greedy, minlength=tiny_target.dims.vocab_size).float())
    # the target's own logits for each step, noised, on the draft's columns: accepted at some anchors, not all
    copied = CopyHead(tiny_target.dims, num_steps=3)(feats).logits
    out = HeadOutput([head.from_target_vocab(x + torch.randn(x.shape, generator=g) * x.std()) for x in copied])
    hits = torch.zeros((3, RANKS), dtype=torch.float64)
    grid = acceptance_grid(head, out, feats, temperature, top_k, top_p, hits)
    sums, counts = alpha_sums(head, out, feats, temperature, top_k, top_p)
    for k in (1, 2, 3):
        assert grid[:, :, k - 1].sum().item() == pytest.approx(sums[k - 1], abs=1e-4)
        full = head.to_target_vocab(scored_logits(out, feats.loss_mask, k))
        best = feats.scored_target_logits(k).argmax(-1, keepdim=True)
        assert hits[k - 1].tolist() == (full.topk(RANKS, -1).indices == best).sum(0).double().tolist()
    assert 0 < sum(sums) < sum(counts)  # neither all accepted nor none: the comparison is not vacuous
    draft_columns = tiny_target.features(ids, feats.loss_mask, layers=head.feature_layers,
                                         columns=head.draft_token_ids())
    with pytest.raises(ValueError, match="whole vocabulary"):  # an argmax over the draft columns is not the target's
        acceptance_grid(head, out, draft_columns, temperature, top_k, top_p)


def test_draft_vocab_coverage_counts_the_answer_tokens_inside_the_draft_vocabulary(fast_cfg, tmp_path, tiny_target):
    """acceptance.json's draft_vocab_coverage, per split, against a count over the held-out records tokenized here;
    a head that drafts the whole vocabulary has none."""
    from safetensors.torch import load_file

    from train.data import chat_example
    from train.main import run

    heldout = tmp_path / "words.jsonl"
    records = [[{"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"Word{i} and zebra{i * 7} quoth the raven, " * (1 + i % 3)}]
               for i in range(8)]
    heldout.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    out = tmp_path / "eagle3"
    record = run(fast_cfg("head=eagle3", "head.hparams.draft_vocab_size=60", "trainer.max_steps=2",
                          f"data.eval_files=[{heldout}]", out=out))
    inside = load_file(str(out / "head" / "model.safetensors"))["t2d"].bool()
    for split, got, parity in (("validation", record, 0), ("test", record["test"], 1)):  # even ranks validate
        hit = total = 0
        for messages in records[parity::2]:
            ex = chat_example(messages, tiny_target.tokenizer, 512)
            answer = ex.input_ids[1:][ex.loss_mask[:-1]]
            hit, total = hit + int(inside[answer].sum()), total + len(answer)
        assert 0 < hit < total  # the 60 training tokens hold some held-out answer tokens, not all
        assert got["draft_vocab_coverage"] == {"0.0": pytest.approx(hit / total)}, split
    whole = run(fast_cfg("head=mtp", "trainer.max_steps=2", f"data.eval_files=[{heldout}]", out=tmp_path / "mtp"))
    assert "draft_vocab_coverage" not in whole and "draft_vocab_coverage" not in whole["test"]
