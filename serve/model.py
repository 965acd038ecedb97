"""The target as the decode loop needs it: a Llama-family forward over a KV cache allocated once.

gpt-fast's shape, reading HF weights: ``Transformer.from_hf(hf_model)`` takes the HF ``LlamaForCausalLM``'s tensors
as they are (no copy, so the HF model and this one share memory), except that q/k/v and gate/up are fused into one
matrix each (fewer, larger matmuls per layer; see `bench step` for what each choice measured). The cache holds
``max_slots`` rows per layer, indexed by *slot*; a forward over T tokens writes rows start..start+T-1 and attends
over rows 0..start+T-1. Rotary positions are separate from slots: in a tree, siblings share a position but not a
slot. Rolling back rejected drafts is just a shorter ``start`` next time (their rows are overwritten); after tree
verification ``compact`` gathers the accepted path's rows into consecutive slots, so the cache is a plain prefix
again.

The forward also returns the hidden states a draft head reads, in HF ``hidden_states`` indexing (k = the input of
decoder layer k, k = num_layers = the final-norm output). Masks are additive floats for SDPA (HF eager attention
gets boolean 4-D masks silently wrong).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads import layers
from heads.layers import apply_rotary
from serve.linear import Linear, add_row_copies, pick_products

SUPPORTED = ("llama", "mistral", "qwen2")  # same block; qwen2 only adds q/k/v biases (config.attention_bias)


COMPILED_MAX_TOKENS = 128  # under Transformer.compile, longer passes run eager (a verify pass: <= 65 tokens)
SERIAL_ATTENTION_TOKENS = 16  # up to this many tokens attention runs on one CPU thread (see attend; 0: never)


class RMSNorm(layers.RMSNorm):
    """heads/'s RMSNorm as one fused ATen op (fp32 only: HF normalises low precision in fp32 before the weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().forward(x)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    """q, k and v as one matmul (qkv_proj: q rows, then k, then v), rotary on q and k at once."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, qkv_bias: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=bias)

    def forward(self, x, cos, sin, k_cache, v_cache, start: int, mask):
        _, T, _ = x.shape
        nH, nKV, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(1, T, nH + 2 * nKV, hd).transpose(1, 2)  # [1, nH + 2 nKV, T, hd]
        qk = apply_rotary(qkv[:, : nH + nKV], cos, sin)
        end = start + T
        k_cache[:, :, start:end] = qk[:, nH:]  # a slice, not an index tensor: no host sync, no copy of the prefix
        v_cache[:, :, start:end] = qkv[:, nH + nKV :]
        q, k, v = qk[:, :nH], k_cache[:, :, :end], v_cache[:, :, :end]
        if torch.compiler.is_compiling() and x.device.type == "cpu":
            return self.o_proj(inline_attention(q, k, v, mask))
        return self.o_proj(attend(q, k, v, mask))


def attend(q, k, v, mask):
    """SDPA over the cache, on one intra-op thread for a pass of a few tokens on CPU.

    CPU SDPA splits a few tokens' attention (9 heads × ≤ 16 rows here) over every OpenMP thread, and the split
    costs far more than it saves: on the project's 2-core box a one-token SmolLM2-135M step took 131 ms with it
    against 65 ms with attention on one thread and the projections still on two (machine shared with a 2-thread
    training job, best of 5; `bench step` prints both rows). For 2-8 token passes the same runs were too
    noisy to call either way. The switch costs well under a microsecond; it is process-wide, so two models
    stepping in parallel threads of one process would see each other's setting.
    q [1, nH, T, hd], k and v [1, nKV, S, hd] -> [1, T, nH·hd], the heads side by side (o_proj's input)."""
    gqa = q.shape[1] != k.shape[1]
    threads = torch.get_num_threads()
    if q.device.type != "cpu" or threads == 1 or q.shape[2] > SERIAL_ATTENTION_TOKENS:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        torch.set_num_threads(1)
        try:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        finally:
            torch.set_num_threads(threads)
    return o.transpose(1, 2).reshape(1, q.shape[2], q.shape[1] * q.shape[3])


def inline_attention(q, k, v, mask):
    """``attend`` as plain products, which a compiled CPU pass (Transformer.compile) runs instead: inductor fuses
    the scale, mask and softmax into its own loops, and with them goes SDPA's per-call overhead and the thread
    switch. A few tokens' attention over a few hundred cached rows is tiny work (9 query heads × 64 here), and SDPA
    spent ~130 µs a layer on it. Measured on SmolLM2-135M, 2 threads, 256 cached tokens (2-core AMD EPYC, idle),
    against the same compiled model with attention as one opaque ``attend`` op, alternating pairs: 0.908 of the
    one-token step (100 pairs) and 0.889 of the 4-token pass (60 pairs; r(4) 1.37 -> 1.17). Sums run in another
    order than SDPA's, so logits match eager to float rounding, as the rest of the compiled pass does.
    q [1, nH, T, hd], k and v [1, nKV, S, hd], mask [T, S] or None -> [1, T, nH·hd]; query head h reads kv head
    h // (nH / nKV), as ``enable_gqa`` does."""
    nH, T, hd = q.shape[1], q.shape[2], q.shape[3]
    nKV = k.shape[1]
    g = nH // nKV
    scores = torch.matmul(q.reshape(nKV, g * T, hd), k[0].transpose(1, 2)).float() * hd ** -0.5  # [nKV, gT, S]
    if mask is not None:
        scores = (scores.view(nKV, g, T, -1) + mask.float()).view(nKV, g * T, -1)
    o = torch.matmul(scores.softmax(-1).to(v.dtype), v[0])  # [nKV, gT, hd]
    return o.view(nH, T, hd).transpose(0, 1).reshape(1, T, nH * hd)


class MLP(nn.Module):
    """gate and up as one matmul (gate_up_proj: gate rows, then up)."""

    def __init__(self, hidden: int, inner: int, bias: bool):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, c, head_dim: int):
        super().__init__()
        bias = bool(getattr(c, "attention_bias", False))
        qkv_bias = bias or c.model_type == "qwen2"
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim, bias, qkv_bias)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, bool(getattr(c, "mlp_bias", False)))

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """A Llama-family decoder with a slot-indexed KV cache (batch 1)."""

    def __init__(self, config, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        c = config
        if c.model_type not in SUPPORTED:
            raise ValueError(f"serve/model.py runs {SUPPORTED} decoders; this target is {c.model_type!r}")
        if getattr(c, "sliding_window", None) and c.model_type == "mistral":
            raise ValueError("sliding-window attention is not implemented in serve/model.py")
        self.config = c
        self.num_layers = c.num_hidden_layers
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, self.head_dim) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.attention_scaling = attention_scaling  # HF's rope scaling factor (1.0 for plain rope)
        # One [1, nKV, S, hd] tensor per layer, not one [L, ...] tensor: a compiled step then writes each layer's
        # new rows in place, where slices of one shared tensor made inductor copy every layer's cache each step.
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self._compiled = None  # the compiled _forward, once compile() is called

    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> "Transformer":
        """Share the HF model's tensors (``assign=True``), same device and dtype; the fused q/k/v and gate/up
        matrices and, on CPU, every projection's [in, out] copy (see serve.linear) are copies made here, so later
        changes to the HF weights are not seen."""
        rotary = hf_model.model.rotary_emb  # HF computed inv_freq for this rope type (default, llama3, ...)
        model = cls(hf_model.config, rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)))
        state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
        if "lm_head.weight" not in state:  # tied embeddings saved once
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(fuse_projections(state), strict=True, assign=True)
        model = model.to(hf_model.device).eval().requires_grad_(False)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        add_row_copies(linears)
        pick_products(linears)  # timed here: which few-token product is fastest depends on the CPU
        return model

    def compile(self, **kwargs) -> "Transformer":
        """Compile the forward with torch.compile (kwargs go to it), gpt-fast's cure for per-op overhead.

        A decode step runs ~2,000 small ops over 30 layers, each paying PyTorch's dispatch (~15 ms of a ~60 ms SmolLM2
        step on a 2-core CPU, docs/results/step-cost.md); compiled, they become a few fused loops per layer between the
        projections (MKL's products, see Linear.compiled_row), attention included (inline_attention). Each pass kind
        (one token; a few, chain or tree; per set of hidden states kept) compiles once, minutes on a small CPU; the
        position ``start`` and the token count turn dynamic on their second value. Results match eager to float rounding
        (the same products; fused norms and rotary sum in another order). One-token projections split their columns over
        two threads if there are two or more now, as eager steps do.

        Prompts stay eager (``last_only`` passes, as the decode loop's prefill is, and any pass over more than
        COMPILED_MAX_TOKENS): they are GEMMs that dispatch overhead barely touches, and every new prompt length,
        hidden-state set and last_only flag cost dynamo another graph, some in the middle of a benchmark's timed
        requests (a 4-head `bench decode` run had compiled 26 graphs and was still compiling)."""
        threads = torch.get_num_threads()  # fixed now: a traced thread query breaks the graph
        pick_products([m for m in self.modules() if isinstance(m, Linear)])  # for the threads it compiles with
        for module in self.modules():
            if isinstance(module, Linear) and module.weight_t is not None:
                d_in, d_out = module.weight_t.shape
                split = threads > 1 and d_out % 2 == 0
                module.halves = module.weight_t.view(d_in, 2, d_out // 2).transpose(0, 1) if split else None
        # One graph per pass kind is expected: one token, a few, a tree, each per set of hidden states kept (one
        # per head family in a benchmark) and once more when a size turns dynamic. Past dynamo's default of 8 the
        # rest would run eagerly, silently slower.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._compiled = torch.compile(self._forward, **kwargs)
        return self

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def max_slots(self) -> int:
        return self.k_cache[0].shape[2] if self.k_cache else 0

    def setup_cache(self, max_slots: int) -> None:
        """Allocate (or keep, when big enough) the KV cache; every later forward only indexes into it."""
        if self.max_slots >= max_slots:
            return
        c = self.config
        shape = (1, c.num_key_value_heads, max_slots, self.head_dim)
        self.k_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
        self.v_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
        # The slot count is a size the compiled graphs take as a symbol from the start: a longer prompt grows the
        # cache, and with the size baked in every graph kind recompiled on the first growth, inside a request.
        for cache in self.k_cache + self.v_cache:
            torch._dynamo.maybe_mark_dynamic(cache, 2)

    def rotary(self, positions: torch.Tensor):
        angles = positions.float()[:, None] * self.inv_freq  # [T, hd/2]
        emb = torch.cat([angles, angles], dim=-1)
        s = self.attention_scaling
        return (emb.cos() * s).to(self.dtype), (emb.sin() * s).to(self.dtype)  # [T, hd] each

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, positions: torch.Tensor | None = None,
                tree_bias: torch.Tensor | None = None, hidden_layers=(), last_only: bool = False):
        """Run tokens [1, T] written to slots start..start+T-1.

        positions: rotary positions [T] (default start..start+T-1). tree_bias: additive mask [T, T] among these
        tokens (default causal); every token sees all slots before ``start``.
        Returns (logits [T, V] float32, or [1, V] with last_only; {k: hidden [1, T, H]} for k in hidden_layers).
        """
        T = tokens.shape[1]
        if start + T > self.max_slots:
            raise ValueError(f"KV cache of {self.max_slots} slots is full (need {start + T}); call setup_cache")
        # Which hidden states to keep, as one bool per index: torch.compile specialises on bools, where the ints of
        # a tuple may be traced as symbols (dynamic=True), and a test saw ``i in hidden_layers`` then keep none.
        keep = tuple(k in hidden_layers for k in range(self.num_layers + 1))
        if self._compiled is None or last_only or T > COMPILED_MAX_TOKENS:  # prompts stay eager: see compile()
            return self._forward(tokens, start, positions, tree_bias, keep, last_only)
        # Chain and tree passes share a graph: both get positions and a block mask, where None for either would be
        # a graph of its own. A slice of a longer id tensor starts at a storage offset, which dynamo guards on (0,
        # 1 or more): a copy of the few ids starts at 0 and costs no graph.
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device)
        if T > 1 and tree_bias is None:
            tree_bias = causal(T, self.dtype, tokens.device)
        return self._compiled(tokens.clone(), start, positions, tree_bias, keep, last_only)

    def _forward(self, tokens, start: int, positions, tree_bias, keep: tuple[bool, ...], last_only: bool):
        T = tokens.shape[1]
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device)
        mask = None
        if T > 1 or tree_bias is not None:  # a single chain token sees every cached row: no mask needed
            block = tree_bias if tree_bias is not None else causal(T, self.dtype, tokens.device)
            mask = torch.cat([block.new_zeros(T, start), block.to(self.dtype)], dim=1)  # [T, start+T]
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(tokens)
        hidden = {}
        for i, layer in enumerate(self.layers):
            if keep[i]:
                hidden[i] = x
            x = layer(x, cos, sin, self.k_cache[i], self.v_cache[i], start, mask)
        x = self.norm(x)
        if keep[self.num_layers]:
            hidden[self.num_layers] = x
        logits = self.lm_head(x[:, -1:] if last_only else x)[0].float()
        return logits, hidden

    @torch.no_grad()
    def compact(self, src_slots: torch.Tensor, dst: int) -> None:
        """Move rows src_slots [n] to slots dst..dst+n-1 in every layer (tree path -> consecutive prefix).

        Advanced indexing reads a copy of the source rows first, so overlapping ranges are safe.
        """
        n = src_slots.shape[0]
        for cache in self.k_cache + self.v_cache:
            cache[:, :, dst : dst + n] = cache[:, :, src_slots]


def fuse_projections(state: dict) -> dict:
    """HF's separate q/k/v and gate/up tensors (weights and any biases) -> qkv_proj and gate_up_proj, per layer."""
    fused = {}
    groups = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    for key, value in state.items():
        prefix, _, name = key.rpartition(".")  # "layers.3.self_attn.q_proj", "weight"
        for target, parts in groups.items():
            if prefix.endswith("." + parts[0]):
                layer = prefix.removesuffix(parts[0])
                fused[f"{layer}{target}.{name}"] = torch.cat([state[f"{layer}{part}.{name}"] for part in parts])
        if not any(prefix.endswith("." + part) for parts in groups.values() for part in parts):
            fused[key] = value
    return fused


def causal(T: int, dtype, device) -> torch.Tensor:
    """[T, T] additive mask: token i sees tokens 0..i."""
    return torch.full((T, T), float("-inf"), dtype=dtype, device=device).triu(1)
