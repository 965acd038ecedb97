"""The disk feature cache: training from it follows the online loss curve; bad shards and other keys are caught."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from train import UserError
from train.main import train


def losses(out: Path) -> list[float]:
    rows = list(csv.DictReader(open(next(out.glob("csv/*/metrics.csv")))))
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


def test_cached_training_follows_online_training(fast_cfg, tmp_path):
    common = ("head=eagle3", "logger=csv", "trainer.max_steps=10", "seed=3")
    online = train(fast_cfg(*common, "data.cache_features=false", out=tmp_path / "online"))
    disk = fast_cfg(*common, "data.cache_features=true", "data.features_on_disk=true",
                    f"data.feature_dir={tmp_path / 'feats'}", out=tmp_path / "disk")
    cached = train(disk)
    info = cached["feature_cache"]
    assert info["shards_built"] == info["shards"] >= 1 and info["bytes_per_token"] == 2 * 64 * len(info["layers"])
    a, b = losses(tmp_path / "online"), losses(tmp_path / "disk")
    assert len(a) == len(b) == 10
    assert np.allclose(a, b, rtol=2e-2, atol=1e-3), (a, b)  # bf16 features: close, not bit-equal
    assert abs(online["alpha"][0] - cached["alpha"][0]) < 0.05
    shards = sorted((tmp_path / "feats").glob("shard-*.npy"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    again = train(fast_cfg(*common, "data.cache_features=true", "data.features_on_disk=true",
                           f"data.feature_dir={tmp_path / 'feats'}", out=tmp_path / "again"))
    assert again["feature_cache"]["shards_built"] == 0 and stamps == [p.stat().st_mtime_ns for p in shards]
    assert losses(tmp_path / "again") == b  # read back from disk: the very same run

    shards[0].write_bytes(shards[0].read_bytes()[: shards[0].stat().st_size // 2])  # a half-written shard
    rebuilt = train(fast_cfg(*common, "data.cache_features=true", "data.features_on_disk=true",
                             f"data.feature_dir={tmp_path / 'feats'}", out=tmp_path / "rebuilt"))
    assert rebuilt["feature_cache"]["shards_built"] == 1 and losses(tmp_path / "rebuilt") == b

    # A head reading fewer layers (Medusa: the last only) is served by this EAGLE-3 cache, as by a cache of its own.
    medusa = ("head=medusa", "logger=csv", "trainer.max_steps=10", "seed=3", "data.cache_features=true",
              "data.features_on_disk=true")
    shared = train(fast_cfg(*medusa, f"data.feature_dir={tmp_path / 'feats'}", out=tmp_path / "medusa"))
    assert shared["feature_cache"]["shards_built"] == 0 and shared["feature_cache"]["layers"] == [info["layers"][-1]]
    own = train(fast_cfg(*medusa, f"data.feature_dir={tmp_path / 'medusa-feats'}", out=tmp_path / "medusa-own"))
    assert own["feature_cache"]["shards_built"] == own["feature_cache"]["shards"]
    assert losses(tmp_path / "medusa") == losses(tmp_path / "medusa-own")  # the same bf16 values, read elsewhere
    assert json.loads((tmp_path / "feats" / "key.json").read_text())["layers"] == info["layers"]

    with pytest.raises(UserError, match="made with other layers.*delete it or set data.feature_dir"):
        train(fast_cfg(*common, "data.cache_features=true", "data.features_on_disk=true",
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
