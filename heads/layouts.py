"""Published head layouts read back as native heads: SafeAILab's EAGLE / EAGLE-3 and FasterDecoding's Medusa.

export/eagle.py and export/medusa.py write these layouts with the key maps here; ``read_state`` reads a directory in
either layout, or a native head/ (heads/checkpoint.py), into the state dict of a head already built for the target,
so train/'s ``init_from=DIR`` fine-tunes a published head. Nothing is guessed: a file that does not fit the head
or its target raises ValueError with one line saying what differs and what to pass instead.

- SafeAILab (eagle/model/ea_model.py, cnets1.py, cnets.py): config.json is a LlamaConfig; weights are
  pytorch_model.bin, else model.safetensors (the client's order). The tensor names are the native ones (the heads
  were named after them): EAGLE-1 ``fc``, ``layers.0.*``; EAGLE-3 ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
  ``d2t``/``t2d`` (absent when the draft vocabulary is the target's). EAGLE-1's ``fc`` has a bias by default
  (config ``bias``, default true), which draftheads' EAGLE-1 has not: only an all-zero one is accepted. An
  ``embed_tokens.weight`` in the file overrides the target's embedding in their loader; ours reads the target's,
  so only one equal to it is accepted. EAGLE-3's fc reads the inputs of layers (2, L//2, L-3) in layer order
  whatever the checkpoint was trained on (modeling_llama_kv.py): the file does not record its target's depth.
  A top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM's directories, same tensor names) names them instead.
- FasterDecoding (medusa/model/medusa_model.py): config.json has medusa_num_heads / medusa_num_layers; weights
  are medusa_lm_head.safetensors, else the pickle medusa_lm_head.pt (read with ``weights_only``). Head h is
  ``Sequential(*[ResBlock(H)] * n, Linear(H, V))``: one ResBlock module repeated, so its file holds the same
  tensors under every l < n, which n untied native layers reproduce exactly.

``draftheads_export.json``, which export/main.py writes beside every export, records the target's identity; when
present it is checked as a native head's is (heads.checkpoint.check_target).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from heads.base import DraftHead
from heads.checkpoint import check_target, load_head

log = logging.getLogger(__name__)
EXPORT_METADATA = "draftheads_export.json"  # export/main.py's METADATA
# The hparams that decide which tensors a head holds and their shapes; the rest (a chain head's K, loss weights,
# the loss vocabulary) are training choices the run's own config keeps.
SHAPE_HPARAMS = {"medusa": ("num_steps", "num_layers", "bias"), "eagle": (), "mtp": ("num_steps",),
                 "eagle3": ("draft_vocab_size", "fc_norm", "norm_output")}


def safeailab_aux(num_layers: int) -> list[int]:
    """The target layers SafeAILab's EAGLE-3 code captures (modeling_llama_kv.py), in the order fc reads them."""
    return sorted({2, num_layers // 2, num_layers - 3})


def medusa_key_map(num_heads: int, num_layers: int) -> dict[str, str]:
    """Native name -> FasterDecoding's name (``{h}.{l}.linear`` for ResBlock l of head h, ``{h}.{n}`` its lm_head)."""
    keys = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            keys[f"blocks.{h}.layers.{layer}.weight"] = f"{h}.{layer}.linear.weight"
            keys[f"blocks.{h}.layers.{layer}.bias"] = f"{h}.{layer}.linear.bias"  # ResBlock's Linear always has one
        keys[f"lm_heads.{h}.weight"] = f"{h}.{num_layers}.weight"
    return keys


def read_state(path, head: DraftHead, target_identity: dict) -> dict[str, torch.Tensor]:
    """The state dict ``head`` (built for its target, and attached to it) loads from DIR: a native head/ (or a run
    directory holding one), a SafeAILab EAGLE / EAGLE-3 directory or a FasterDecoding Medusa directory."""
    path = Path(path)
    if not (path / "config.json").exists() and (path / "head" / "config.json").exists():
        path = path / "head"  # a training run's directory
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json; pass a head/ directory a training run wrote, or a "
                                "SafeAILab EAGLE or FasterDecoding Medusa directory")
    config = json.loads((path / "config.json").read_text())
    if (path / EXPORT_METADATA).exists():  # written by our export: the target it was exported for
        check_target(json.loads((path / EXPORT_METADATA).read_text()), target_identity)
    if "family" in config and "dims" in config:
        state, ckpt_hparams, ids = native_state(path, head, target_identity)
    elif "medusa_num_heads" in config:
        (state, ckpt_hparams), ids = medusa_state(path, config, head), None
    else:
        state, ckpt_hparams, ids = eagle_state(path, config, head)
    if ids is not None:
        state["fc.weight"] = fc_for(state["fc.weight"], ids, list(head.aux_layers), path)
    mine = head.hparams()
    differ = {k: v for k, v in ckpt_hparams.items() if k in SHAPE_HPARAMS.get(head.family, ()) and v != mine.get(k)}
    if differ:
        raise ValueError(f"{path} holds a {head.family} head with {differ}, this run's head has "
                         f"{ {k: mine.get(k) for k in differ} }; pass "
                         + " ".join(f"head.hparams.{k}={json.dumps(v)}" for k, v in differ.items()))
    check_shapes(state, head, path)
    return state


def check_family(family: str, head: DraftHead, path: Path, layout: str) -> None:
    if family != head.family:
        raise ValueError(f"{path} holds {family} weights ({layout} layout) but this run trains head={head.family}; "
                         f"pass head={family}")


def native_state(path: Path, head: DraftHead, target_identity: dict):
    """A native head/ -> (its state, its hparams, fc's layer ids for EAGLE-3 else None)."""
    saved, config = load_head(path)
    check_family(saved.family, head, path, "draftheads")
    check_target(config, target_identity)
    ids = list(saved.aux_layers) if saved.family == "eagle3" else None
    return saved.state_dict(), config["hparams"], ids


def check_dims(hidden: int, vocab: int | None, head: DraftHead, path: Path) -> None:
    """The target's width and vocabulary, read off the files (published heads carry no target identity)."""
    d = head.dims
    for name, mine, theirs in (("hidden size", hidden, d.hidden_size), ("vocabulary", vocab, d.vocab_size)):
        if mine is not None and mine != theirs:
            raise ValueError(f"{path} was trained for a target with {name} {mine}; this target has {theirs}: use "
                             "the target it was trained for (its base model)")


def eagle_state(path: Path, config: dict, head: DraftHead):
    """SafeAILab's EAGLE-1 / EAGLE-3 files -> (native state, shape hparams, fc's layer ids for EAGLE-3 else None)."""
    tensors = read_weights(path, ("pytorch_model.bin", "model.safetensors"))
    if "fc.weight" not in tensors:
        raise ValueError(f"{path} is not a draftheads head, a SafeAILab EAGLE or a FasterDecoding Medusa directory "
                         f"(config.json keys {sorted(config)[:8]}, no fc.weight)")
    family = "eagle3" if any(k.startswith("midlayer.") for k in tensors) else "eagle"
    check_family(family, head, path, "SafeAILab")
    H = tensors["fc.weight"].shape[0]
    check_dims(config.get("target_hidden_size", H), config.get("vocab_size"), head, path)
    if config.get("target_hidden_size", H) != H:
        raise ValueError(f"{path}'s draft is {H} wide over a {config['target_hidden_size']}-wide target; "
                         "draftheads' heads share the target's width")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path} has {config['num_hidden_layers']} draft decoder layers; draftheads' {family} has one")
    warn_rope(config, head, path)
    bias = tensors.pop("fc.bias", None)
    if bias is not None and bias.any():
        raise ValueError(f"{path}'s fc has a bias (SafeAILab's EAGLE-1 default, bias: true); draftheads' EAGLE-1 fc "
                         "has none, so this head cannot be carried over exactly: retrain it with bias: false")
    embed = tensors.pop("embed_tokens.weight", None)
    target_embed = head.frozen("embed_tokens").weight
    if embed is not None and (embed.shape != target_embed.shape or not torch.allclose(
            embed.float(), target_embed.float().cpu(), rtol=1e-2, atol=1e-3)):  # fp16/bf16 rounding passes
        raise ValueError(f"{path} carries its own token embedding, not this target's, and draftheads' heads read "
                         "the target's: use the target it was trained for")
    if family == "eagle":
        return tensors, {}, None
    Vd, L = tensors["lm_head.weight"].shape[0], head.dims.num_layers
    tensors["d2t"], tensors["t2d"] = vocab_maps(tensors.get("d2t"), tensors.get("t2d"), Vd, head.dims.vocab_size, path)
    ids = config.get("eagle_aux_hidden_state_layer_ids") or safeailab_aux(L)
    if len(ids) != 3:
        raise ValueError(f"{path} is read as SafeAILab's code reads it, tapping layers (2, L//2, L-3) = "
                         f"{[2, L // 2, L - 3]} of this {L}-layer target, which repeat: use the target it was "
                         "trained for")
    return tensors, {"draft_vocab_size": Vd, "fc_norm": False, "norm_output": False}, list(ids)  # EAGLE-3.0 only


def medusa_state(path: Path, config: dict, head: DraftHead):
    """FasterDecoding's Medusa files -> (native state, shape hparams)."""
    check_family("medusa", head, path, "FasterDecoding")
    tensors = read_weights(path, ("medusa_lm_head.safetensors", "medusa_lm_head.pt"))
    n = int(config.get("medusa_num_layers", 1))
    K = len({k.split(".")[0] for k in tensors})
    keys = medusa_key_map(K, n)
    missing = [theirs for theirs in keys.values() if theirs not in tensors]
    if missing:
        raise ValueError(f"{path} is not a {K}-head, {n}-layer FasterDecoding Medusa file: it lacks {missing[:4]}")
    state = {native: tensors[theirs] for native, theirs in keys.items()}
    check_dims(state["blocks.0.layers.0.weight"].shape[1], state["lm_heads.0.weight"].shape[0], head, path)
    biased = any(state[k].any() for k in keys if k.endswith(".bias"))
    if not biased and not head.bias:  # an all-zero bias (our export of a bias-free head) is no bias
        state = {k: v for k, v in state.items() if not k.endswith(".bias")}
    return state, {"num_steps": K, "num_layers": n, **({"bias": True} if biased else {})}


def read_weights(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The first of ``names`` present: safetensors, or a torch pickle read with ``weights_only`` (no code runs)."""
    for name in names:
        f = path / name
        if not f.exists():
            continue
        try:
            if name.endswith(".safetensors"):
                return load_file(str(f))
            return dict(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # safetensors and torch raise several types for truncated or foreign files
            raise ValueError(f"cannot read {f}: {str(e).splitlines()[0]}; the file is missing or corrupt") from e
    raise FileNotFoundError(f"{path} has config.json but none of {', '.join(names)}")


def vocab_maps(d2t, t2d, Vd: int, V: int, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's (d2t, t2d) checked against each other; without d2t the draft vocabulary must be the target's."""
    if d2t is None:
        if Vd != V:
            raise ValueError(f"{path}'s lm_head has {Vd} rows but no d2t says which of the target's {V} tokens they "
                             "are")
        return torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    targets = d2t.long() + torch.arange(Vd)
    if d2t.shape != (Vd,) or targets.min() < 0 or targets.max() >= V or targets.unique().numel() != Vd:
        raise ValueError(f"{path}'s d2t does not map its {Vd} draft tokens to distinct ids of this target's {V}")
    reach = torch.zeros(V, dtype=torch.bool)
    reach[targets] = True
    if t2d is not None and not torch.equal(t2d.bool(), reach):
        raise ValueError(f"{path}'s t2d marks other target tokens than its d2t reaches; the file is inconsistent")
    return d2t.long(), reach


def fc_for(fc: torch.Tensor, ids: list[int], aux_layers: list[int], path: Path) -> torch.Tensor:
    """EAGLE-3's fc [H, 3H], its column blocks re-laid from the layers the file reads (``ids``) to the head's."""
    if ids == aux_layers:
        return fc
    if len(set(ids)) != 3 or sorted(ids) != sorted(aux_layers):
        raise ValueError(f"{path}'s fc reads target layers {ids}, this head reads {aux_layers}; pass "
                         f"head.hparams.aux_layers={json.dumps(ids)} (or use the target the head was trained for)")
    H = fc.shape[0]
    return torch.cat([fc[:, ids.index(k) * H : (ids.index(k) + 1) * H] for k in aux_layers], dim=1)  # [H, 3H]


def warn_rope(config: dict, head: DraftHead, path: Path) -> None:
    theta = config.get("rope_theta", 10000.0)  # LlamaConfig's default, which SafeAILab's layer then uses
    if float(theta) != head.dims.rope_theta or config.get("rope_scaling"):
        log.warning("%s: SafeAILab's draft layer ran with rope_theta %s, rope_scaling %s; draftheads' uses the "
                    "target's (%s): the imported head starts from a slightly different function", path, theta,
                    config.get("rope_scaling"), head.dims.rope_theta)


def check_shapes(state: dict[str, torch.Tensor], head: DraftHead, path: Path) -> None:
    want = head.state_dict()
    missing, unused = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unused:
        raise ValueError(f"{path} does not hold a {head.family} head's tensors: missing {missing[:4]}, unused "
                         f"{unused[:4]}")
    for k, v in state.items():
        if v.shape != want[k].shape:
            raise ValueError(f"{path}'s {k} is {list(v.shape)}, a {head.family} head on this target has "
                             f"{list(want[k].shape)}: the head was trained for another target; use that one")
