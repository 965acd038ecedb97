"""The disk feature cache: training from it follows the online loss curve; bad shards and other keys are caught."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from train import UserError
from train.main import run


def losses(out: Path) -> list[float]:
    rows = list(csv.DictReader(open(next(out.glob("csv/*/metrics.csv")))))
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


def test_cached_training_follows_online_training(fast_cfg, tmp_path):
    common = ("head=eagle3", "logger=csv", "trainer.max_steps=10", "seed=3")
    online = run(fast_cfg(*common, "data.cache_features=false", out=tmp_path / "online"))
    disk = fast_cfg(*common, "data.cache_features=true", "data.features_on_disk=true",
                    f"data.feature_dir={tmp_path / 'feats'}", out=tmp_path / "disk")
    cached = run(disk)
    info = cached["feature_cache"]
    assert info["shards_built"] == info["shards"] >= 1 and info["bytes_per_token"] == 2 * 64 * len(info["layers"])
    a, b = losses(tmp_path / "online"), losses(tmp_path / "disk")
    assert len(a) == len(b) == 10
    assert np.allclose(a, b, rtol=2e-2, atol=1e-3), (a, b)  # bf16 features: close, not bit-equal
    assert abs(online["alpha"][0] - cached["alpha"][0]) < 0.05
    shards = sorted((tmp_path / "feats").glob("shard-*.npy"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    again = run(fast_cfg(*common, "data.cache_features=true", "data.features_on_disk=true",
                         f"data.feature_dir={tmp_path / 'feats'}", out=tmp_path / "again"))
    assert again["feature_cache"]["shards_built"] == 0 and stamps == [p.stat().st_mtime_ns for p in shards]
    assert losses(tmp_path / "again") == b  # read back from disk: the very same run

    shards[0].write_bytes(shards[0].read_bytes()[: shards[0].stat().st_size // 2])  # a half-written shard
    rebuilt = run(fast_cfg(*common, "data.cache_features=true", "data.features_on_disk=true",
                           f"data.feature_dir={tmp_path / 'feats'}", out=tmp_path / "rebuilt"))
    assert rebuilt["feature_cache"]["shards_built"] == 1 and losses(tmp_path / "rebuilt") == b

    # A head reading fewer layers (Medusa: the last only) is served by this EAGLE-3 cache, as by a cache of its own.
    medusa = ("head=medusa", "logger=csv", "trainer.max_steps=10", "seed=3", "data.cache_features=true",
              "data.features_on_disk=true")
    shared = run(fast_cfg(*medusa, f"data.feature_dir={tmp_path / 'feats'}", out=tmp_path / "medusa"))
    assert shared["feature_cache"]["shards_built"] == 0 and shared["feature_cache"]["layers"] == [info["layers"][-1]]
    own = run(fast_cfg(*medusa, f"data.feature_dir={tmp_path / 'medusa-feats'}", out=tmp_path / "medusa-own"))
    assert own["feature_cache"]["shards_built"] == own["feature_cache"]["shards"]
    assert losses(tmp_path / "medusa") == losses(tmp_path / "medusa-own")  # the same bf16 values, read elsewhere
    assert json.loads((tmp_path / "feats" / "key.json").read_text())["layers"] == info["layers"]

    with pytest.raises(UserError, match="made with other layers.*delete it or set data.feature_dir"):
        run(fast_cfg(*common, "data.cache_features=true", "data.features_on_disk=true",
                     f"data.feature_dir={tmp_path / 'medusa-feats'}", out=tmp_path / "eagle3-on-medusa"))


def test_default_cache_dirs_serve_a_subset_of_their_layers(tmp_path, monkeypatch):
    """With no data.feature_dir, any per-key directory of the same target and data holding more layers is found."""
    from types import SimpleNamespace

    from train.feature_cache import superset_dir
    from train.regenerate import keyed_dir

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    key = {"version": 1, "target": {"name": "t"}, "data_sha256": "abc", "layers": [30], "max_len": 512}
    made = {"t-1": {**key, "layers": [2, 15, 27, 30]}, "t-2": {**key, "data_sha256": "other", "layers": [2, 30]},
            "u-3": {**key, "layers": [1, 30]}}  # another target's name
    for name, k in made.items():
        (tmp_path / "features" / name).mkdir(parents=True)
        (tmp_path / "features" / name / "key.json").write_text(json.dumps(k))
    target = SimpleNamespace(name="t")
    assert superset_dir(None, target, key) == (tmp_path / "features" / "t-1", [2, 15, 27, 30])
    assert superset_dir(None, target, {**key, "layers": [2, 3, 30]}) is None  # layer 3 is nowhere
    assert superset_dir(None, target, {**key, "max_len": 256}) is None
    assert superset_dir(str(tmp_path / "features" / "t-2"), target, {**key, "data_sha256": "other"}) == \
        (tmp_path / "features" / "t-2", [2, 30])
    exact = keyed_dir(None, "features", target, key)  # a directory of its own, maybe complete: it wins
    exact.mkdir(parents=True)
    (exact / "key.json").write_text(json.dumps(key))
    assert superset_dir(None, target, key) is None


def test_grown_data_links_the_shards_an_earlier_cache_holds(tiny_target, tmp_path, monkeypatch):
    """Data that extends earlier data (a bigger seeded sample) computes only its new shards; the rest are hard links
    to the earlier cache's files, holding what a fresh build computes. Other layers or an explicit dir: no links."""
    import torch

    from train.data import Example
    from train.feature_cache import attach

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    vocab = tiny_target.dims.vocab_size
    data = [Example(torch.randint(3, vocab, (n,)), torch.ones(n, dtype=torch.bool)) for n in (9, 5, 12, 7, 6, 11)]
    fresh = lambda: [Example(ex.input_ids, ex.loss_mask) for ex in data]  # noqa: E731  (no features attached yet)
    small, grown, own = fresh()[:4], fresh(), fresh()
    first = attach(tiny_target, small, [1, 2], 64, shard_size=2)
    assert (first["shards"], first["shards_built"], first["shards_reused"]) == (2, 2, 0)
    info = attach(tiny_target, grown, [1, 2], 64, shard_size=2)
    assert (info["shards"], info["shards_built"], info["shards_reused"]) == (3, 1, 2)
    for s in range(2):
        a, b = Path(first["dir"]) / f"shard-{s:05d}.npy", Path(info["dir"]) / f"shard-{s:05d}.npy"
        assert a.stat().st_ino == b.stat().st_ino  # a link: no second copy on disk
    alone = attach(tiny_target, own, [1, 2], 64, root=str(tmp_path / "alone"), shard_size=2)  # explicit: no links
    assert alone["shards_built"] == 3 and alone["shards_reused"] == 0
    for g, o in zip(grown, own):
        assert all(torch.equal(g.hidden[k], o.hidden[k]) for k in (1, 2))
    other = attach(tiny_target, fresh(), [1, 3], 64, shard_size=2)  # other layers: nothing to link
    assert (other["shards_built"], other["shards_reused"]) == (3, 0)
    Path(first["dir"], "shard-00000.npy").unlink()  # deleted here, still held by the grown data's cache
    again = attach(tiny_target, fresh()[:4], [1, 2], 64, shard_size=2)
    assert (again["shards_built"], again["shards_reused"]) == (0, 1)
    Path(info["dir"], "shard-00002.npy").write_bytes(b"half")  # a corrupt shard is rebuilt, never linked elsewhere
    assert attach(tiny_target, fresh(), [1, 2], 64, shard_size=2)["shards_built"] == 1


def test_midrun_alpha_gap_is_the_bf16_disk_features_alone(fast_cfg, tmp_path):
    """Mid-run checks read the cached features (bf16 on disk); the final α runs the target. acceptance.json gives
    the kept head's difference between the two: zero with fp32 features in memory, small but recorded on disk."""
    common = ("head=eagle3", "head.hparams.num_steps=3", "logger=none", "trainer.max_steps=8",
              "trainer.val_check_interval=8", "data.cache_features=true", "seed=3")
    disk = run(fast_cfg(*common, "data.features_on_disk=true", f"data.feature_dir={tmp_path / 'feats'}",
                        out=tmp_path / "disk"))
    memory = run(fast_cfg(*common, "data.features_on_disk=false", out=tmp_path / "memory"))
    for record in (disk, memory):
        (check,) = [c for c in record["heldout_checks"] if c["step"] == record["head_step"]]
        assert record["midrun_alpha_gap"] == pytest.approx([a - c for a, c in zip(record["alpha"], check["alpha"])])
    assert memory["midrun_alpha_gap"] == pytest.approx([0.0] * 3, abs=1e-9)
    assert max(map(abs, disk["midrun_alpha_gap"])) < 0.05, disk["midrun_alpha_gap"]


def test_a_bf16_feature_pass_is_keyed_apart_and_near_the_target_dtype(tiny_target, tmp_path, monkeypatch):
    """data.feature_precision=bf16 runs the training text's pass under bf16 autocast: its cache directory is its own,
    no shard is linked between it and a target-dtype cache either way, and its features are near the float32 ones
    without being the same values."""
    import torch

    from train.data import Example
    from train.feature_cache import attach

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    vocab = tiny_target.dims.vocab_size
    data = [Example(torch.randint(3, vocab, (n,)), torch.ones(n, dtype=torch.bool)) for n in (9, 5, 12, 7)]
    fresh = lambda: [Example(ex.input_ids, ex.loss_mask) for ex in data]  # noqa: E731
    full, half = fresh(), fresh()
    fp32 = attach(tiny_target, full, [1, 2], 64, shard_size=2)
    bf16 = attach(tiny_target, half, [1, 2], 64, shard_size=2, autocast=torch.bfloat16)
    assert (fp32["pass_autocast"], bf16["pass_autocast"]) == (None, "bfloat16")
    assert bf16["dir"] != fp32["dir"] and (bf16["shards_built"], bf16["shards_reused"]) == (2, 0)
    for a, b in zip(full, half):
        for k in (1, 2):
            err = float((a.hidden[k].float() - b.hidden[k].float()).norm() / a.hidden[k].float().norm())
            assert 0 < err < 0.1, (k, err)
    Path(fp32["dir"], "shard-00000.npy").unlink()  # the bf16 cache holds the same sequences: still not a donor
    again = attach(tiny_target, fresh(), [1, 2], 64, shard_size=2)
    assert again["dir"] == fp32["dir"] and (again["shards_built"], again["shards_reused"]) == (1, 0)


def test_bf16_feature_pass_leaves_the_heldout_features_in_the_target_dtype(tiny_target, chat_files):
    """Mid-run checks must see what the final α sees: with data.feature_precision=bf16 (features in memory) the
    training text's features change and the held-out text's are the target dtype's, bit for bit. A bad choice is
    refused before any work, naming the choices."""
    import torch

    from train.data import DataConfig, DraftDataModule

    def cached(precision: str) -> DraftDataModule:
        cfg = DataConfig(train_files=[str(chat_files[0])], eval_files=[str(chat_files[1])], cache_features=True,
                         feature_precision=precision)
        data = DraftDataModule(cfg, tiny_target)
        data.prepare(layers=(1,))
        data.cache_features([1])
        return data

    full, half = cached("target"), cached("bf16")
    last = tiny_target.dims.num_layers
    assert all(torch.equal(a.hidden[k], b.hidden[k]) for a, b in zip(full.eval_examples, half.eval_examples)
               for k in (1, last))
    assert not any(torch.equal(a.hidden[1], b.hidden[1]) for a, b in zip(full.train_examples, half.train_examples))
    with pytest.raises(UserError, match="data.feature_precision='fp16'; choose target, bf16 or bf16-if-native"):
        DataConfig(feature_precision="fp16")
