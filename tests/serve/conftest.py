"""serve/ fixtures: heads for every family (perturbed, and "oracle" ones that often draft the right token), and
the target's own greedy decoding as the reference."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from heads import build_head
from heads.checkpoint import save_head
from serve.model import Transformer


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and several helpers share this machine's two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def runner_model(target) -> Transformer:
    return Transformer.from_hf(target.model)


def perturbed_head(family, target, model, num_steps=3, std=0.02, seed=1):
    """A head initialised from the target and randomly perturbed: wrong often, right sometimes."""
    head = build_head(family, target.dims, num_steps=num_steps)
    head.attach_modules(model.embed_tokens, model.lm_head, model.norm)
    if family == "eagle3":  # a reduced draft vocabulary (3/4 of the target's), so -inf columns are exercised
        V = target.dims.vocab_size
        head = build_head(family, target.dims, num_steps=num_steps, draft_vocab_size=3 * V // 4)
        head.attach_modules(model.embed_tokens, model.lm_head, model.norm)
        head.set_vocab_map(torch.rand(target.dims.vocab_size, generator=torch.Generator().manual_seed(seed)))
    head.init_from_target()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return head.eval()


def write_heads_and_prompts(d: Path, target, families) -> Path:
    """What serve/ and bench read from disk: DIR/FAMILY/head with an acceptance.json beside it (α 0.6/0.5/0.4 at
    T = 0), and DIR/prompts.jsonl with one record in each prompt layout (chat, plain prompt, Spec-Bench)."""
    model = runner_model(target)
    for family in families:
        save_head(perturbed_head(family, target, model), d / family / "head", target.identity())
        (d / family / "acceptance.json").write_text(json.dumps(
            {"alpha": [0.6, 0.5, 0.4], "temperature": 0.0, "alpha_by_temperature": {"0.0": [0.6, 0.5, 0.4]}}))
    lines = [{"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
             {"prompt": "Once upon a time", "id": "story"},
             {"question_id": 7, "category": "qa", "turns": ["Why is the sky blue?", "And the sea?"]}]
    (d / "prompts.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return d


class OracleHead:
    """Wraps a real head (its caches, commits and steps all run) and, with probability ``hit``, boosts the token
    the target's greedy decoding really has at the predicted position. Acceptance is then high but not certain,
    which exercises multi-token accepts, rejections at every depth, rollback and tree compaction."""

    def __init__(self, head, reference: list[int], hit: float = 0.75, seed: int = 0):
        self.head, self.reference, self.hit, self.seed = head, reference, hit, seed
        self.anchor = 0

    def __getattr__(self, name):  # family, feature_layers, max_draft_steps, ...: the real head's
        return getattr(self.head, name)

    def boost(self, logits, index: int, salt: int):
        """logits [V]: make the reference token at sequence index ``index`` the favourite, sometimes."""
        if index >= len(self.reference) or random.Random(self.seed * 7919 + index * 31 + salt).random() >= self.hit:
            return logits
        tok = self.reference[index]
        if not torch.isfinite(logits[tok]):  # unreachable in a reduced draft vocabulary
            return logits
        logits = logits.clone()
        logits[tok] = logits[torch.isfinite(logits)].max() + 5.0
        return logits

    def new_cache(self, *args):
        return self.head.new_cache(*args)

    def commit(self, cache, hidden, next_tokens, start):
        logits, state = self.head.commit(cache, hidden, next_tokens, start)
        self.anchor = start + next_tokens.shape[1] - 1  # step k predicts sequence index anchor + 1 + k
        return self.boost(logits[0], self.anchor + 2, 1)[None], state

    def step(self, cache, state, token, depth):
        logits, state = self.head.step(cache, state, token, depth)
        return self.boost(logits[0], self.anchor + 1 + depth, depth)[None], state

    def step_tree(self, cache, h, tokens, positions, slots, bias):
        logits, out = self.head.step_tree(cache, h, tokens, positions, slots, bias)
        rows = [self.boost(logits[i], int(p) + 2, int(p) - self.anchor + 1) for i, p in enumerate(positions)]
        return torch.stack(rows), out


@torch.no_grad()
def hf_greedy(hf_model, prompt: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """The target's own greedy decoding (HF forward with its cache, no EOS handling) and, per token, the gap
    between its top two logits (to tell a floating-point tie from a real mismatch)."""
    out = hf_model(prompt[None], use_cache=True)
    tokens, gaps = [], []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        tokens.append(int(logits.argmax()))
        gaps.append(float(top2[0] - top2[1]))
        out = hf_model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, gaps


def assert_same_greedy(got: list[int], ref: list[int], gaps: list[float], tie: float = 1e-4):
    """Token-for-token equal, except that after a floating-point tie (top-2 gap < tie) the paths may part."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert gaps[i] < tie, f"token {i}: runner {a} != target {b} (top-2 gap {gaps[i]:.2e}, not a tie)"
            return
    assert len(got) == len(ref)


@pytest.fixture(scope="session")
def chaotic_target():
    """tiny-random with weights at std 0.2: its greedy text varies token to token (the default init repeats one
    token forever, which would let cache or position bugs go unnoticed)."""
    from heads.target import load_target

    target = load_target("tiny-random")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in target.model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2, generator=g)
    return target


@pytest.fixture(scope="session")
def smollm2_target():
    from heads.target import load_target

    return load_target("smollm2-135m")


class NoisyTargetHead(OracleHead):
    """Wraps a real head but drafts from the target's own next-token logits plus Gaussian noise (recomputed
    with a full HF forward over the sequence and the drafts so far): q close to p, so drafts are often kept
    under sampling, and the real head's cache code still runs alongside."""

    def __init__(self, head, hf_model, prompt: list[int], noise: float = 1.0, seed: int = 0):
        super().__init__(head, [], 0.0, seed)
        self.hf_model, self.noise = hf_model, noise
        self.tokens = list(prompt[:1])  # the rest arrives through commit's next_tokens
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def target_logits(self, seq: list[int]):
        logits = self.hf_model(torch.tensor([seq])).logits[0, -1].float()
        return logits + self.noise * torch.randn(logits.shape, generator=self.generator)

    def commit(self, cache, hidden, next_tokens, start):
        _, state = self.head.commit(cache, hidden, next_tokens, start)
        self.tokens = self.tokens[: start + 1] + next_tokens[0].tolist()
        self.drafted = []
        return self.target_logits(self.tokens)[None], state

    def step(self, cache, state, token, depth):
        _, state = self.head.step(cache, state, token, depth)
        self.drafted = self.drafted[: depth - 2] + [int(token)]
        return self.target_logits(self.tokens + self.drafted)[None], state
