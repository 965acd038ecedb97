"""serve/model.py computes what HF computes: logits and hidden states, in chunks over its cache (with each of
serve/linear.py's few-token products), for tree passes under a tree mask, and after gathering a tree path into
consecutive slots."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import serve.linear as serve_linear
from serve.linear import (FEW_TOKENS, PICK_TOKENS, PRODUCTS, SWITCH_GAIN, Linear, fast_linears, product_for,
                          spans)
from serve.model import Transformer
from serve.verify import tree_attention_bias, tree_depths

from tests.serve.conftest import perturbed_head

pytestmark = pytest.mark.usefixtures("one_thread")


def check_chunks(target, T=40, chunks=(0, 23, 24, 31), atol=1e-4, product=None):
    """Prefill and decode in uneven chunks == one HF forward, for logits and every hidden_states index (with every
    projection's few-token passes, here of 7 and 9 tokens, forced to ``product`` when given)."""
    model = Transformer.from_hf(target.model)
    if product is not None:
        for m in model.modules():
            if isinstance(m, Linear):
                m.few = ((FEW_TOKENS, product),)
    model.setup_cache(64)
    L = model.num_layers
    ids = torch.randint(0, target.dims.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    ref = target.features(ids, layers=range(L + 1))
    bounds = list(chunks) + [T]
    logits, hidden = [], {k: [] for k in range(L + 1)}
    for a, b in zip(bounds[:-1], bounds[1:]):
        lg, h = model(ids[:, a:b], a, hidden_layers=tuple(range(L + 1)))
        logits.append(lg)
        for k in h:
            hidden[k].append(h[k])
    torch.testing.assert_close(torch.cat(logits), ref.target_logits[0], atol=atol, rtol=1e-4)
    for k in range(L + 1):
        torch.testing.assert_close(torch.cat(hidden[k], 1), ref.hidden[k], atol=atol, rtol=1e-4)
    last, _ = model(ids[:, :T], 0, last_only=True)
    torch.testing.assert_close(last[0], ref.target_logits[0, -1], atol=atol, rtol=1e-4)


def test_equals_hf_tiny(tiny_target):
    check_chunks(tiny_target)


@pytest.mark.parametrize("product", PRODUCTS)
def test_every_few_token_product_equals_hf(tiny_target, product):
    check_chunks(tiny_target, product=product)


def test_from_hf_picks_a_product_for_every_pass_size(tiny_target):
    """Every projection gets spans that cover 2..FEW_TOKENS tokens in order, each naming a product it can run."""
    model = Transformer.from_hf(tiny_target.model)
    for m in [m for m in model.modules() if isinstance(m, Linear)]:
        bounds = [upto for upto, _ in m.few]
        assert bounds == sorted(set(bounds)) and bounds[-1] == FEW_TOKENS
        assert {product for _, product in m.few} <= set(PRODUCTS)
        assert product_for(m.few, FEW_TOKENS + 1) == "linear"  # past FEW_TOKENS: nn.Linear's product


def test_pick_times_a_small_model_over_no_more_weight_than_it_holds(tiny_target, monkeypatch):
    """A model smaller than COLD_BYTES is timed over its own projections' bytes (it runs from cache), not over
    COLD_BYTES of copies: a tiny shape timed over 64 MiB took ~3 s of copies and calls per load."""
    real, seen = serve_linear.time_products, []

    def recording(weight, weight_t, read_bytes):
        seen.append(read_bytes)
        return real(weight, weight_t, read_bytes)

    monkeypatch.setattr(serve_linear, "_picked", {})  # timed afresh, not reused from an earlier test
    monkeypatch.setattr(serve_linear, "time_products", recording)
    model = Transformer.from_hf(tiny_target.model)
    held = sum(m.weight.nbytes for m in model.modules() if isinstance(m, Linear))
    assert held < serve_linear.COLD_BYTES
    assert seen and set(seen) == {held}


def test_spans_keep_the_fastest_product_per_size_and_ignore_near_ties():
    """A size's fastest product holds up to the next timed size; a product within SWITCH_GAIN of the one before it
    does not cut a new span, one clearly faster does."""
    seconds = {}
    for T in PICK_TOKENS:
        seconds["linear", T] = 1.0
        seconds["row_copy", T] = 1.0 + 0.5 * SWITCH_GAIN if T < 4 else 0.5  # near tie below 4 tokens, then 2x faster
        seconds["transposed", T] = 3.0
    seconds["row_copy", 2] = 0.9  # fastest at the first size
    got = spans(seconds)
    assert got == ((FEW_TOKENS, "row_copy"),)  # 3 tokens: linear only 5% faster, so row_copy holds
    seconds["row_copy", 2] = 1.1
    got = spans(seconds)
    assert got == ((3, "linear"), (FEW_TOKENS, "row_copy"))
    assert [product_for(got, T) for T in (2, 3, 4, 12)] == ["linear", "linear", "row_copy", "row_copy"]


def test_two_threads_equals_hf(tiny_target):
    """On two intra-op threads a pass of up to SERIAL_ATTENTION_TOKENS runs attention on one (serve.model.attend):
    chunks of 23 (threaded), 1, 7 and 9 tokens still equal HF, and both threads are handed back."""
    torch.set_num_threads(2)
    try:
        check_chunks(tiny_target)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_one_token_product_on_two_threads_is_x_times_wt(tiny_target):
    """A one-token projection on two threads (a bmm over the [in, out] copy's column halves) equals x @ Wt bit for
    bit, for every projection and an odd-width one (which keeps x @ Wt)."""
    model = Transformer.from_hf(tiny_target.model)
    odd = Linear(16, 7)
    odd.weight_t = odd.weight.detach().t().contiguous()
    g = torch.Generator().manual_seed(0)
    torch.set_num_threads(2)
    try:
        for lin in [m for m in model.modules() if isinstance(m, Linear)] + [odd]:
            x = torch.randn(1, 1, lin.in_features, generator=g)
            expected = x @ lin.weight_t + (0 if lin.bias is None else lin.bias)
            assert torch.equal(lin(x), expected)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fast_linears_draft_as_before(tiny_target, family, threads):
    """A head given the runner's projections (fast_linears, as serve/ loads heads) drafts the same logits as
    before, on one thread and on two (where one-token products split their columns): no nn.Linear is left, and
    no weight or bias was dropped or transposed on the way."""
    model = Transformer.from_hf(tiny_target.model)
    model.setup_cache(64)
    head = perturbed_head(family, tiny_target, model)
    tokens = torch.randint(0, tiny_target.dims.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    _, hidden = model(tokens[:, :-1], 0, hidden_layers=head.feature_layers)
    torch.set_num_threads(threads)
    try:
        def draft():
            cache = head.new_cache(64, "cpu", torch.float32)
            logits, state = head.commit(cache, hidden, tokens[:, 1:], 0)
            out = [logits]
            for depth in (2, 3):
                logits, state = head.step(cache, state, logits.argmax(-1), depth)
                out.append(logits)
            return torch.cat(out)

        before = draft()
        fast_linears(head)
        assert not any(type(m) is nn.Linear for m in head.modules())
        torch.testing.assert_close(draft(), before, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(1)


@pytest.mark.shared
def test_equals_hf_stories(stories_target):
    check_chunks(stories_target)


@pytest.mark.slow
def test_equals_hf_smollm2(smollm2_target):
    check_chunks(smollm2_target, atol=5e-4)


def test_tree_pass_and_compaction(chaotic_target):
    """Each tree node's logits equal HF's on prefix + the node's branch; after compacting one branch into
    consecutive slots, decoding continues exactly as if that branch had been the only one."""
    target = chaotic_target
    model = Transformer.from_hf(target.model)
    model.setup_cache(64)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 256, (1, 10), generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]
    tokens = torch.randint(0, 256, (len(parents),), generator=g)
    model(prefix, 0)
    depth = tree_depths(parents)
    logits, _ = model(tokens[None], 10, positions=10 + depth, tree_bias=tree_attention_bias(parents))

    def branch(i):
        path = [i]
        while parents[path[-1]] > 0:
            path.append(parents[path[-1]])
        return [0] + path[::-1] if i else [0]

    for i in range(len(parents)):
        seq = torch.cat([prefix[0], tokens[branch(i)]])[None]
        ref = target.model(seq).logits[0, -1].float()
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)

    path = branch(7)  # [0, 2, 5, 7]: not consecutive, so compaction moves rows
    model.compact(10 + torch.tensor(path[1:]), 11)
    nxt = torch.tensor([[3]])
    got, _ = model(nxt, 10 + len(path))
    seq = torch.cat([prefix[0], tokens[path], nxt[0]])[None]
    torch.testing.assert_close(got[0], target.model(seq).logits[0, -1].float(), atol=1e-4, rtol=1e-4)


def test_full_cache_is_refused(tiny_target):
    model = Transformer.from_hf(tiny_target.model)
    model.setup_cache(8)
    with pytest.raises(ValueError, match="full"):
        model(torch.zeros(1, 9, dtype=torch.long), 0)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_forward_equals_eager(chaotic_target, threads):
    """Transformer.compile traces the whole forward as one graph (fullgraph: no thread query or switch is traced),
    and on one thread (one-token projections as mm) or two (as baddbmm over the column halves, mm for the odd-width
    lm_head) a prompt with hidden states, one-token steps at moving positions and a tree pass give eager's logits,
    hidden states and cache rows."""
    torch.set_num_threads(threads)
    try:
        eager = Transformer.from_hf(chaotic_target.model)
        compiled = Transformer.from_hf(chaotic_target.model).compile(fullgraph=True, dynamic=True)
        linears = [m for m in compiled.modules() if isinstance(m, Linear)]  # the lm_head's 259 columns stay whole
        assert [m.halves is not None for m in linears] == [threads > 1 and m.out_features % 2 == 0 for m in linears]
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, 256, (1, 24), generator=g)
        parents = [-1, 0, 0, 1]
        tree = torch.randint(0, 256, (1, len(parents)), generator=g)
        for model in (eager, compiled):
            model.setup_cache(40)
        runs = [dict(tokens=ids[:, :20], start=0, hidden_layers=(1, 2))]
        runs += [dict(tokens=ids[:, i : i + 1], start=i) for i in range(20, 24)]
        runs += [dict(tokens=tree, start=24, positions=24 + tree_depths(parents),
                      tree_bias=tree_attention_bias(parents), hidden_layers=(2,))]
        for run in runs:
            (want, want_h), (got, got_h) = eager(**run), compiled(**run)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert got_h.keys() == want_h.keys()
            for k in want_h:
                torch.testing.assert_close(got_h[k], want_h[k], atol=1e-4, rtol=1e-4)
        for mine, theirs in zip(compiled.k_cache + compiled.v_cache, eager.k_cache + eager.v_cache):
            torch.testing.assert_close(mine[:, :, :28], theirs[:, :, :28], atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(1)


@pytest.mark.slow
def test_compiled_steps_survive_a_longer_prompt(chaotic_target):
    """A longer prompt grows the KV cache (setup_cache). The compiled graphs take its slot count as a symbol, so the
    decode passes after the growth reuse them: with the size baked in, every pass kind recompiled on the first
    growth, inside a timed request (`bench decode` --compile at T = 0). Dynamo is told to raise on a recompile."""
    torch.set_num_threads(1)
    model = Transformer.from_hf(chaotic_target.model).compile()
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    model.setup_cache(24)
    model(ids[:, :16], 0, last_only=True)
    for i in range(16, 19):  # the second position makes ``start`` dynamic
        model(ids[:, i : i + 1], i)
    model(ids[:, 19:22], 19)
    model(ids[:, 19:23], 19)  # the second size makes the token count dynamic
    model.setup_cache(80)
    assert model.max_slots == 80
    model(ids[:, :60], 0, last_only=True)  # prompts run eager
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, _ = model(ids[:, 60:61], 60)
        few, _ = model(ids[:, 61:65], 61)
    eager = Transformer.from_hf(chaotic_target.model)
    eager.setup_cache(80)
    eager(ids[:, :61], 0)
    torch.testing.assert_close(got[0], eager(ids[:, 60:61], 60)[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(few, eager(ids[:, 61:65], 61)[0], atol=1e-4, rtol=1e-4)
