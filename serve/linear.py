"""The runner's projections: nn.Linear with the CPU matrix products a decode loop's passes run fastest.

A decode loop runs two kinds of short passes, and on a CPU the obvious ``x·Wᵀ`` is not the fastest product for
either: the one-token step (plain decoding and every draft step) and the verify pass over a few tokens (γ + 1 for a
chain, the nodes of a small tree), whose cost r(γ + 1) is the speculative speedup's denominator. Long passes
(prompts) keep nn.Linear: GEMMs BLAS already runs well.

Which few-token product is fastest depends on the CPU's BLAS, so it is timed on the machine (``pick_products``)
rather than fixed. Three products, the same sum in different orders (results match to float rounding):
- 2-core AMD EPYC with AVX2 (2026-11-30, one thread, a 4-token pass's products): (W·xᵀ)ᵀ 81 ms, x·Wᵀ 142 ms, x·Wt
  twice as slow as (W·xᵀ)ᵀ. (W·xᵀ)ᵀ was the fixed choice until 2026-12-05.
- 2-core Intel Xeon with AMX (2026-12-05, 2 threads, one layer's four projections at 2 / 4 / 8 tokens): x·Wᵀ
  171 / 409 / 591 µs, (W·xᵀ)ᵀ 569 / 572 / 622, x·Wt 203 / 219 / 293. With (W·xᵀ)ᵀ fixed, a compiled 2-token pass
  cost 2.32 one-token passes and every speculative setting ran at 0.55-0.63x plain decoding with a head of α₁ 0.57;
  picked here, r(2) 1.23 and chain γ = 1 1.10x plain (docs/results/serving-and-adaptive.md).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

FEW_TOKENS = 16  # up to this many tokens a projection runs its picked few-token product (see Linear)
WEIGHT_T_MAX_BYTES = 4 << 30  # the [in, out] copies double weight memory: only for targets a CPU box holds twice
SWITCH_GAIN = 0.1  # a larger pass size changes product only where another is this much faster (see spans)
PRODUCTS = ("linear", "transposed", "row_copy")  # x·Wᵀ (nn.Linear's), (W·xᵀ)ᵀ, x·Wt (the [in, out] copy)
COLD_BYTES = 64 << 20  # the most the pick's timing reads per call of a product, in copies of the weight (time_products)
PICK_TOKENS = (2, 3, 4, 6, 8, 12, 16)  # pass sizes timed (chains of γ = 1-3, small trees); between two, the lower's


class Linear(nn.Linear):
    """nn.Linear that picks its CPU products for the decode loop's short passes.

    A one-token step reads a second copy of the weight stored [in, out] (``weight_t``): MKL's x·Wᵀ for one row
    streams the weights ~25% slower than x·Wt on the AVX2 EPYC (single thread, weights out of cache), and the
    one-token step is what vanilla decoding and drafting repeat. The cost is the weights' memory twice over on CPU.
    With more than one thread the one-token product runs as one ``bmm`` over the copy's two column halves (a strided
    view, no second copy): MKL computes a one-row product on one thread however many it is given, while ``bmm``
    hands each half to its own thread. Whole one-token step, 2 threads, the two layouts interleaved in one process
    (60 rounds; five processes, either built first): 0.86-0.90× of x·Wt's time. On one thread the halves cost ~20%
    more, so one thread keeps x·Wt. The halves are the same columns: the result is bit-identical to x·Wt.

    A pass of 2..FEW_TOKENS tokens runs the product ``pick_products`` timed fastest on this machine for this shape
    and about that many tokens (``few``: spans of token counts; see the module docstring). In eager passes (W·xᵀ)ᵀ's
    result is made contiguous again: left as the transposed view, every later op (rotary, SDPA, which then falls
    back to its math path) ran on hd-major strides and a 4-token pass cost ~25% more."""

    weight_t: torch.Tensor | None = None  # [in, out] copy for one-token steps on CPU (set by add_row_copies)
    halves: torch.Tensor | None = None  # weight_t as [2, in, out/2] (a view), set by Transformer.compile on >1 thread
    few: tuple = ((FEW_TOKENS, "transposed"),)  # (up to T tokens, product) spans, set by pick_products

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # rows as a head reads them out ([1, H] a chain step, [N, H] a tree's nodes): T = rows
            return self.forward(x[None])[0]
        if torch.compiler.is_compiling() and x.device.type == "cpu":  # see Transformer.compile
            if self.weight_t is not None and x.shape[-2] == 1 and x.dim() == 3:
                return self.compiled_row(x)
            # A comparison of the token count, not an index by it: dynamo guards a dynamic size's range, so a graph
            # per span compiles, not one per size. A view left as it is: inductor lays it out for its reader.
            few = product_for(self.few, x.shape[-2]) if few_tokens(x) else "linear"
            if few != "linear":
                out = few_token_product(x, self.weight, self.weight_t, few)[None]
                return out if self.bias is None else out + self.bias
            return F.linear(x, self.weight, self.bias)
        return project(x, self.weight, self.weight_t, self.bias, self.few)

    def compiled_row(self, x: torch.Tensor) -> torch.Tensor:
        """``project``'s one-token product in ops inductor leaves to MKL: it lowers a one-row ``bmm`` to its own
        loops (half MKL's speed here), but calls ``baddbmm`` (= bmm at beta=0) and ``mm`` as they are."""
        d_in = x.shape[-1]
        if self.halves is None:
            out = (x.view(1, d_in) @ self.weight_t).view(1, 1, -1)
        else:
            out = torch.baddbmm(x.new_zeros(2, 1, self.halves.shape[2]), x[0].expand(2, 1, d_in), self.halves, beta=0)
            out = out.transpose(0, 1).reshape(1, 1, -1)
        return out if self.bias is None else out + self.bias


def fast_linears(module: nn.Module) -> nn.Module:
    """Make every nn.Linear under ``module`` this file's Linear, in place: same tensors, plus on CPU the [in, out]
    copy its one-token products read (add_row_copies) and its picked few-token product. For a draft head, whose
    drafting is a chain of one-token steps (or a tree's few nodes): its projections (and a Medusa or EAGLE-3 head's
    own lm_head) then run as the target's do. Modules the head only references (the target's embedding and lm_head)
    are not its children and are left alone."""
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                fast = Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                fast.weight, fast.bias = child.weight, child.bias
                setattr(parent, name, fast)
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    add_row_copies(linears)
    pick_products(linears)
    return module


def add_row_copies(linears: list[Linear]) -> None:
    """On CPU, give each Linear the [in, out] copy its one-token products read, if all the copies together stay
    within WEIGHT_T_MAX_BYTES (they double the weights' memory)."""
    if linears and linears[0].weight.device.type == "cpu" and \
            sum(m.weight.nbytes for m in linears) <= WEIGHT_T_MAX_BYTES:
        for m in linears:
            m.weight_t = m.weight.detach().t().contiguous()


_picked: dict[tuple, tuple] = {}  # (shape, dtype, threads, has the copy, bytes read) -> spans: timed once per process


def pick_products(linears: list[Linear]) -> None:
    """Set each CPU Linear's few-token products to those that ran fastest on this machine for its weight's shape
    at the current thread count, per pass size. Timed once per shape and thread count in a process (SmolLM2-135M:
    six shapes, ~3 s on a 2-core CPU); Transformer.compile picks again for the thread count it compiles with.
    The timing reads as much weight as a pass over these linears does, up to COLD_BYTES: a model that fits in the
    caches (stories260K: 1 MB) is timed in them, as its passes run; timed over 64 MiB of copies, each of its tiny
    shapes took ~3 s to pick and the test suite ran minutes longer."""
    cpu = [m for m in linears if m.weight.device.type == "cpu"]
    read_bytes = min(COLD_BYTES, sum(m.weight.nbytes for m in cpu))
    for m in cpu:
        key = (tuple(m.weight.shape), m.weight.dtype, torch.get_num_threads(), m.weight_t is not None, read_bytes)
        if key not in _picked:
            _picked[key] = spans(time_products(m.weight, m.weight_t, read_bytes))
        m.few = _picked[key]


def spans(seconds: dict[tuple[str, int], float]) -> tuple:
    """((up to T tokens, product), ...) from {(product, T): seconds}: each timed size's fastest product holds up to
    the next timed size, and neighbours with the same product merge. The smaller size's product stays unless another
    is SWITCH_GAIN faster: a near tie timed on a noisy machine would otherwise cut spans, and each span boundary a
    compiled pass crosses is one more graph."""
    out: list[tuple[int, str]] = []
    for T, upto in zip(PICK_TOKENS, [t - 1 for t in PICK_TOKENS[1:]] + [FEW_TOKENS]):
        fastest = min((p for p, t in seconds if t == T), key=lambda p: seconds[p, T])
        if out and seconds[out[-1][1], T] <= (1 + SWITCH_GAIN) * seconds[fastest, T]:
            fastest = out[-1][1]
        if out and out[-1][1] == fastest:
            out[-1] = (upto, fastest)
        else:
            out.append((upto, fastest))
    return tuple(out)


def product_for(spans: tuple, T) -> str:
    """The product ``spans`` give a pass of T tokens; past the last span, nn.Linear's."""
    for upto, product in spans:
        if T <= upto:
            return product
    return "linear"


@torch.inference_mode()
def time_products(weight: torch.Tensor, weight_t: torch.Tensor | None, read_bytes: int = COLD_BYTES,
                  rounds: int = 3) -> dict[tuple[str, int], float]:
    """Seconds per call of each few-token product at each PICK_TOKENS size, over copies of the weight totalling
    ``read_bytes`` (at least the weight itself): the best of ``rounds`` rounds in which the products take turns, so
    a slow spell of a noisy machine lands on all of them, not on one."""
    products = [p for p in PRODUCTS if p != "row_copy" or weight_t is not None]
    xs = [torch.randn(1, T, weight.shape[1], dtype=weight.dtype) for T in PICK_TOKENS]
    # Copies enough to leave a core's own caches, read in turn: a pass reads each layer's weights from farther out
    # (the shared L3 or memory), and a small matrix timed alone stays in L1/L2, which misranked them (2 tokens,
    # SmolLM2's 30 layers cycled on an AMX Xeon: x·Wᵀ 17.8 ms, x·Wt 22.4; timed cached, each layer's x·Wt was within
    # 20% and won some shapes). That Xeon reports a 480 MiB L3, so 64 MiB of copies still time L3, not memory.
    copies = [(weight, weight_t)] + [(weight.clone(), None if weight_t is None else weight_t.clone())
                                     for _ in range(read_bytes // weight.nbytes - 1)]  # a large matrix: itself
    best = {(p, T): math.inf for p in products for T in PICK_TOKENS}
    for _ in range(rounds):
        for x in xs:
            for p in products:
                spans_p = ((FEW_TOKENS, p),)
                t0 = time.perf_counter()
                for w, w_t in copies:
                    project(x, w, w_t, None, spans_p)
                best[p, x.shape[1]] = min(best[p, x.shape[1]], (time.perf_counter() - t0) / len(copies))
    return best


def project(x, weight, weight_t, bias, few: tuple = ((FEW_TOKENS, "transposed"),)):
    """``Linear``'s eager product: x·Wt (as column halves on several threads) for one token, ``few``'s for a few."""
    T = x.shape[-2]
    if weight_t is not None and T == 1 and x.dim() == 3:
        d_in, d_out = weight_t.shape
        if d_out % 2 or torch.get_num_threads() == 1:
            out = x @ weight_t  # [1, 1, out]
        else:  # [2, 1, in] @ [2, in, out/2]: a half per thread
            halves = weight_t.view(d_in, 2, d_out // 2).transpose(0, 1)
            out = torch.bmm(x[0].expand(2, 1, d_in), halves).transpose(0, 1).reshape(1, 1, d_out)
        return out if bias is None else out + bias
    product = product_for(few, x.shape[-2]) if x.device.type == "cpu" and few_tokens(x) else "linear"
    if product == "linear":
        return F.linear(x, weight, bias)
    out = few_token_product(x, weight, weight_t, product).contiguous()  # [T, out]
    if bias is not None:
        out = out + bias
    return out[None]


def few_tokens(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.shape[0] == 1 and 1 < x.shape[1] <= FEW_TOKENS


def few_token_product(x: torch.Tensor, weight: torch.Tensor, weight_t, few: str) -> torch.Tensor:
    """x [1, T, in] -> x·Wᵀ [T, out]: from the [in, out] copy (``row_copy``) or as (W·xᵀ)ᵀ, a transposed view."""
    if few == "row_copy":
        return x[0] @ weight_t
    return (weight @ x[0].transpose(0, 1)).transpose(0, 1)
