"""What every engine format shares: the export context, Llama config fields, layer key specs and the aux-layer map.

A format file (vllm.py, sglang.py, ...) is an explicit key map from the native head (heads/checkpoint.py) to the
names one engine's loader reads, plus the parameter set that loader builds *from the written config* (``expected``)
and a reference forward that reads the written files the way that engine does. This module holds the pieces they
have in common so each format file stays a readable key map.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from heads.base import DraftHead, TargetDims
from heads.errors import UserError  # noqa: F401  (export's entry points raise it; one definition for all)


class ExportRefused(ValueError):
    """The head cannot be carried by the requested format (the message says what it can go to)."""


@dataclass
class Written:
    """One export before it touches disk: config.json, tensors (one safetensors file) and any extra files."""

    config: dict
    tensors: dict[str, torch.Tensor]
    weights_file: str = "model.safetensors"
    extra: dict[str, bytes] = field(default_factory=dict)  # filename -> content (pickles, scripts)


@dataclass
class ExportContext:
    """Everything a format needs, resolved once by export/main.py."""

    head: DraftHead
    head_config: dict  # the native head's config.json
    target_identity: dict  # heads.target.Target.identity() of the loaded target
    target_path: str | None  # the target's HF directory for engine commands (None: in-process tiny-random)
    gamma: int  # draft tokens per round written into engine configs/commands
    dtype: torch.dtype  # dtype of floating tensors written
    recommended: dict = field(default_factory=dict)  # serve/'s measured settings, when present
    acceptance: dict = field(default_factory=dict)  # train/'s acceptance.json beside the head, when present
    target: object = None  # the loaded heads.target.Target (MTP copies its embedding and lm_head)

    @property
    def family(self) -> str:
        return self.head.family

    @property
    def dims(self) -> TargetDims:
        return self.head.dims

    def state(self) -> dict[str, torch.Tensor]:
        """The head's tensors in the export dtype (int/bool buffers keep theirs)."""
        return {k: cast(v, self.dtype) for k, v in self.head.state_dict().items()}


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- Llama config fields ---------------------------------------------------------------------------------------
def llama_config(dims: TargetDims, dtype: torch.dtype, num_layers: int = 1, **extra) -> dict:
    """A plain HF LlamaConfig dict with the target's dimensions (what vLLM/SGLang/llama.cpp/SafeAILab read).

    Both ``rope_theta`` (transformers 4 readers: llama.cpp's converter, SafeAILab) and ``rope_parameters``
    (transformers 5) are written; tie_word_embeddings is explicit because SGLang's EAGLE classes alias
    lm_head to embed_tokens when it is true.
    """
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": dims.hidden_size, "intermediate_size": dims.intermediate_size,
        "num_attention_heads": dims.num_heads, "num_key_value_heads": dims.num_kv_heads, "head_dim": dims.head_dim,
        "num_hidden_layers": num_layers, "vocab_size": dims.vocab_size, "hidden_act": "silu",
        "rms_norm_eps": dims.rms_norm_eps, "rope_theta": dims.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
        "max_position_embeddings": dims.max_position_embeddings, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": dtype_name(dtype), **extra,
    }


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def layer_spec(prefix: str, cfg: dict, in_features: int, input_norm: bool, hidden_norm: bool = False) -> dict:
    """Expected {key: shape} of one Llama decoder layer as an engine builds it from ``cfg``."""
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], head_dim(cfg)
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    spec = {
        f"{prefix}.self_attn.q_proj.weight": (q, in_features), f"{prefix}.self_attn.k_proj.weight": (kv, in_features),
        f"{prefix}.self_attn.v_proj.weight": (kv, in_features), f"{prefix}.self_attn.o_proj.weight": (H, q),
        f"{prefix}.mlp.gate_proj.weight": (I, H), f"{prefix}.mlp.up_proj.weight": (I, H),
        f"{prefix}.mlp.down_proj.weight": (H, I), f"{prefix}.post_attention_layernorm.weight": (H,),
    }
    if input_norm:
        spec[f"{prefix}.input_layernorm.weight"] = (H,)
    if hidden_norm:
        spec[f"{prefix}.hidden_norm.weight"] = (H,)
    return spec


def rename(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    """Prefix map: every key starting with ``old`` gets ``new`` instead."""
    return {new + k[len(old):]: v for k, v in state.items() if k.startswith(old)}


# -- EAGLE-3 aux layers ----------------------------------------------------------------------------------------
def engine_aux(head, avoid: tuple[int, ...] = (0,)) -> tuple[list[int], torch.Tensor]:
    """Three distinct ascending aux ids (HF hidden_states index = input of decoder layer k) and fc re-laid for them.

    Engines capture each layer once and concatenate in ascending layer order (vLLM: interfaces.py
    ``_maybe_add_hidden_state`` in the layer loop; SGLang: llama.py ``layers_to_capture`` in the loop), so a head
    whose aux_layers are unsorted or repeat a layer (heads.eagle3's default for a 5-layer target is (2, 2, 2))
    is rewritten exactly: fc's column blocks are permuted, blocks of a repeated layer are summed
    (fc is linear), and missing ids are filled with unused layers whose fc block is zero.

    EAGLE 3.1's per-block fc_norm (RMSNorm(x) = x / rms(x) * g) is folded into fc: block j becomes W_j diag(g_j),
    and the written fc_norm weights are ones (``fc_norm_weights``). rms(x) does not depend on g, so this is exact,
    and it keeps the permuting and summing above exact too.
    """
    H, L = head.dims.hidden_size, head.dims.num_layers
    W = head.fc.weight.detach()  # [H, 3H] column block j reads aux_layers[j]
    gains = [n.weight.detach() for n in head.fc_norm] if getattr(head, "fc_norm", None) is not None else None
    blocks: dict[int, torch.Tensor] = {}
    for j, k in enumerate(head.aux_layers):
        block = W[:, j * H : (j + 1) * H]
        blocks[k] = blocks.get(k, 0) + (block * gains[j][None, :] if gains else block)
    spare = [k for k in range(L - 1, -1, -1) if k not in blocks and k not in avoid] + [k for k in avoid if k < L]
    for k in spare:
        if len(blocks) == 3:
            break
        if k not in blocks:
            blocks[k] = torch.zeros_like(W[:, :H])  # a captured layer the draft ignores
    ids = sorted(blocks)
    return ids, torch.cat([blocks[k] for k in ids], dim=1)  # [H, 3H]


def fc_norm_weights(head) -> dict[str, torch.Tensor]:
    """EAGLE 3.1's fc_norm tensors as engines name them (``fc_norm.{i}.weight``), ones: engine_aux folded the gains
    into fc. Empty for a head without fc_norm."""
    if getattr(head, "fc_norm", None) is None:
        return {}
    return {f"fc_norm.{i}.weight": torch.ones(head.dims.hidden_size) for i in range(len(head.fc_norm))}


def eagle31_flags(head) -> dict:
    """The config fields vLLM 0.32 and speculators 0.9 read for EAGLE 3.1 (llama_eagle3.py ``getattr(config, ...)``)."""
    hp = head.hparams()
    return {"fc_norm": hp["fc_norm"], "norm_output": hp["norm_output"]}


def fc_norm_spec(cfg: dict, hidden: int, n_aux: int) -> dict:
    """The fc_norm tensors' expected shapes (``expected()``'s form) in an engine config that sets fc_norm."""
    if not cfg.get("fc_norm"):
        return {}
    return {f"fc_norm.{i}.weight": ((cfg.get("target_hidden_size", hidden),), None) for i in range(n_aux)}


def vocab_maps(head) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [V_draft] int64 offsets, t2d [V] bool) of an EAGLE-3 head."""
    return head.d2t.detach().cpu().long(), head.t2d.detach().cpu().bool()


def reduced_vocab(head) -> bool:
    """Engines carry d2t/t2d only when the draft vocabulary is smaller (vLLM 0.32 builds no draft_id_to_target_id
    otherwise; speculators sets t2d/d2t to None; SafeAILab deletes them)."""
    return head.draft_vocab_size != head.dims.vocab_size


# -- files -----------------------------------------------------------------------------------------------------
def write_dir(out: Path, written: Written) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(written.config, indent=2) + "\n")
    if written.tensors:
        save_file(written.tensors, str(out / written.weights_file), metadata={"format": "pt"})
        (out / written.weights_file).chmod(0o644)  # safetensors writes 0600; engines may run as another user
    for name, content in written.extra.items():
        (out / name).write_bytes(content)


def read_dir(out: str | Path, weights_file: str = "model.safetensors") -> tuple[dict, dict[str, torch.Tensor]]:
    out = Path(out)
    return json.loads((out / "config.json").read_text()), load_file(str(out / weights_file))


def target_path_or_placeholder(ctx: ExportContext) -> str:
    return ctx.target_path or "/path/to/target"
