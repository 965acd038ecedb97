"""The target's features on disk: computed once, memory-mapped by every later run (EAGLE's offline features).

Only what the head reads is kept: its tapped layers plus the last (post-norm) state, from which the module
recomputes the target's logits with the lm_head. Values are bf16 (stored as int16 bit patterns in ``.npy`` files,
since numpy has no bf16), one shard per ``shard_size`` training sequences: ``[tokens, len(layers) * H]`` rows with
the sequences back to back. The directory is keyed by the target's identity, a hash of the tokenised training
data, the layer ids and max_len (``key.json``); a directory built for anything else is refused, except that one
holding more layers than asked serves the layers it has (an EAGLE-3 cache, layers 2/15/27/30, feeds a Medusa,
EAGLE-1 or MTP run on the same data, which reads only layer 30). Shards are written to a temp file and renamed, and a
shard whose size or shape is not what ``key.json`` promises is rebuilt, never read.

``shards.json`` lists a hash of each shard's sequences. A shard another cache directory of the same target, layers,
max_len and shard size already holds is hard-linked from there instead of computed: data that grows (6,000 reference
records, then 14,000 of the same seeded sample) pays the feature pass only for its new shards.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from heads.target import Target
from train.regenerate import keyed_dir, keyed_dirs, open_keyed_dir, read_key, write_atomic

log = logging.getLogger(__name__)


def data_hash(examples) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(ex.input_ids.numpy().tobytes())
        h.update(ex.loss_mask.numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def cache_key(target: Target, examples, layers, max_len: int, shard_size: int,
              autocast: torch.dtype | None = None) -> dict:
    key = {"version": 1, "target": target.identity(), "data_sha256": data_hash(examples), "layers": list(layers),
           "max_len": max_len, "shard_size": shard_size, "dtype": "bfloat16",
           "lengths": [len(ex.input_ids) for ex in examples]}
    if autocast is not None:  # only then: the keys (and directories) of caches made in the target's dtype stay valid
        key["pass_autocast"] = str(autocast).removeprefix("torch.")
    return key


def superset_dir(root: str | None, target: Target, key: dict) -> tuple[Path, list[int]] | None:
    """A cache directory whose key equals ``key`` but for holding more layers, and its layers; else None.
    ``root`` (data.feature_dir) is the only candidate when set; else every per-key directory of this target.
    A directory made for exactly ``key`` wins: it may be complete where a bigger one is half built."""
    if read_key(keyed_dir(root, "features", target, key)) == key:
        return None
    for path, old in ([(Path(root), read_key(Path(root)))] if root else cache_dirs(target)):
        if old and {**old, "layers": key["layers"]} == key and set(key["layers"]) < set(old["layers"]):
            return path, old["layers"]
    return None


def cache_dirs(target: Target) -> list[tuple[Path, dict]]:
    """(directory, key) of every readable per-key feature cache of this target under ~/.cache/draftheads."""
    return keyed_dirs("features", target)


def donor_shards(root: str | None, target: Target, key: dict, into: Path) -> dict[str, Path]:
    """{shard hash: shard file} of the other per-key directories of this target whose shards hold the same layers,
    max_len and shard size (their ``shards.json``). Empty with an explicit data.feature_dir: the directories next
    to it are the user's, not ours to read."""
    if root:
        return {}

    def shape_of(k: dict) -> dict:  # what a shard's bytes depend on, beyond the sequences it holds
        return {n: v for n, v in k.items() if n not in ("data_sha256", "lengths")}

    wanted, found = shape_of(key), {}
    for path, old in cache_dirs(target):
        if path == into or shape_of(old) != wanted:  # both ways: a bf16-pass shard never serves a float32 cache
            continue
        try:
            hashes = json.loads((path / "shards.json").read_text())["shard_sha256"]
        except (OSError, ValueError, KeyError):
            continue
        found.update({h: path / f"shard-{s:05d}.npy" for s, h in enumerate(hashes) if h not in found})
    return found


def link_shard(donor: Path, file: Path, tokens: int, width: int) -> bool:
    """Hard-link (or copy, across file systems) a complete donor shard to ``file``; False if the donor is not whole.
    Shards are only ever replaced by rename, never written in place, so a shared inode never changes under a reader."""
    if read_shard(donor, tokens, width) is None:
        return False
    tmp = file.with_name(f"{file.name}.{os.getpid()}.link")
    try:
        tmp.unlink(missing_ok=True)
        os.link(donor, tmp)
        os.replace(tmp, file)
    except OSError:  # another file system, or no hard links: a copy, as atomic as a built shard
        tmp.unlink(missing_ok=True)
        with open(donor, "rb") as src:
            write_atomic(file, lambda f: shutil.copyfileobj(src, f), "data.feature_dir")
    return True


def read_shard(path: Path, tokens: int, width: int) -> np.ndarray | None:
    """The shard memory-mapped (copy-on-write: torch wants writable arrays, the file is never written), or None."""
    try:
        arr = np.load(path, mmap_mode="c")
    except (OSError, ValueError, EOFError):
        return None
    return arr if arr.shape == (tokens, width) and arr.dtype == np.int16 else None


def pass_autocast(choice: str, target: Target) -> torch.dtype | None:
    """The dtype the training text's feature pass autocasts to (data.feature_precision); None: no autocast."""
    weight = next(target.model.parameters())
    if choice == "target" or weight.dtype != torch.float32:
        return None  # a half-precision target (GPUs) already runs its pass in half precision
    if choice == "bf16-if-native" and weight.device.type == "cpu":
        from train.trainer import cpu_has_bf16_units

        return torch.bfloat16 if cpu_has_bf16_units() else None
    return torch.bfloat16


@torch.no_grad()
def compute(target: Target, examples, layers, batch_size: int, autocast: torch.dtype | None = None
            ) -> list[torch.Tensor]:
    """[T, len(layers) * H] bf16 features per example (kept-from-generation features are reused as they are);
    ``autocast``: run the target's matmuls in that dtype (data.feature_precision)."""
    device = next(target.model.parameters()).device
    out: list[torch.Tensor | None] = [None] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].input_ids))
    for b0 in range(0, len(order), batch_size):
        idx = order[b0:b0 + batch_size]
        if all(examples[i].hidden is not None and set(layers) <= set(examples[i].hidden) for i in idx):
            for i in idx:
                out[i] = torch.cat([examples[i].hidden[k] for k in layers], -1).to(torch.bfloat16)
            continue
        T = max(len(examples[i].input_ids) for i in idx)
        ids = torch.full((len(idx), T), target.tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(idx), T), dtype=torch.long)
        for r, i in enumerate(idx):  # right padding, as training batches are padded
            n = len(examples[i].input_ids)
            ids[r, :n], attn[r, :n] = examples[i].input_ids, 1
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            hidden = target.hidden_states(ids.to(device), None if bool(attn.all()) else attn.to(device), layers)
        for r, i in enumerate(idx):
            n = len(examples[i].input_ids)
            out[i] = torch.cat([hidden[k][r, :n] for k in layers], -1).to(torch.bfloat16).cpu()
    return out


def attach(target: Target, examples, layers, max_len: int, root: str | None = None, shard_size: int = 512,
           batch_size: int = 8, autocast: torch.dtype | None = None) -> dict:
    """Give every example ``hidden`` {k: [T, H] bf16 memory-mapped view}, building missing shards first."""
    wanted = sorted(set(layers))
    H = target.dims.hidden_size
    key = cache_key(target, examples, wanted, max_len, shard_size, autocast)
    found = superset_dir(root, target, key)
    if found:  # a cache built for a head that reads more layers: read our columns out of its shards
        path, layers = found
        log.info("feature cache %s holds layers %s; reading %s from it", path, layers, wanted)
    else:
        path, layers = open_keyed_dir(root, "features", target, key, "data.feature_dir"), wanted
    shards = [range(s, min(s + shard_size, len(examples))) for s in range(0, len(examples), shard_size)]
    hashes = [data_hash(examples[i] for i in idx) for idx in shards]
    manifest = json.dumps({"shard_sha256": hashes}).encode()  # what this data's shards hold, for later donors
    if not (path / "shards.json").exists() or (path / "shards.json").read_bytes() != manifest:
        write_atomic(path / "shards.json", lambda f: f.write(manifest), "data.feature_dir")
    width, built, reused, donors = len(layers) * H, 0, 0, None
    for s, idx in enumerate(tqdm(shards, desc="feature cache", unit="shard", leave=False)):
        file = path / f"shard-{s:05d}.npy"
        tokens = sum(len(examples[i].input_ids) for i in idx)
        arr = read_shard(file, tokens, width)
        if arr is None:
            donors = donor_shards(root, target, {**key, "layers": layers}, path) if donors is None else donors
            if hashes[s] in donors and link_shard(donors[hashes[s]], file, tokens, width):
                arr, reused = read_shard(file, tokens, width), reused + 1
        if arr is None:
            if file.exists():
                log.warning("feature cache shard %s is incomplete or corrupt: rebuilding it", file)
            rows = torch.cat(compute(target, [examples[i] for i in idx], layers, batch_size, autocast))  # [tokens, W]
            write_atomic(file, lambda f: np.save(f, rows.view(torch.int16).numpy()), "data.feature_dir")
            arr, built = read_shard(file, tokens, width), built + 1
        flat = torch.from_numpy(arr).view(torch.bfloat16)  # [tokens, L * H], no copy
        offset = 0
        for i in idx:
            n = len(examples[i].input_ids)
            examples[i].hidden = {k: flat[offset:offset + n, j * H:(j + 1) * H] for j, k in enumerate(layers)
                                  if k in wanted}
            offset += n
    info = {"dir": str(path), "shards": len(shards), "shards_built": built, "shards_reused": reused,
            "layers": wanted, "layers_on_disk": layers, "bytes_per_token": width * 2, "tokens": sum(key["lengths"]),
            "pass_autocast": key.get("pass_autocast")}
    log.info("feature cache %s: %d shards (%d built now, %d linked from other caches), %d tokens, %d bytes/token",
             path, len(shards), built, reused, info["tokens"], info["bytes_per_token"])
    return info
