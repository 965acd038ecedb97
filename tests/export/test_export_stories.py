"""stories260K (../shared): every supported (family, format) pair exports and its engine-style reference forward
reproduces the head on the real model. A 5-layer target is the hard case for EAGLE-3: the default aux layers
(2, L//2, L-3) = (2, 2, 2) repeat, which no engine captures; exports fold them exactly, SafeAILab's code cannot."""
from __future__ import annotations

import json

import pytest

from export import FORMATS, ExportRefused

PAIRS = [(family, fmt) for fmt, module in FORMATS.items() for family in module.FAMILIES]


@pytest.mark.shared
@pytest.mark.parametrize("family,fmt", PAIRS)
def test_stories_export(family, fmt, stories_target, head_dir, run_export, tmp_path):
    hp = {"draft_vocab_size": 200} if family == "eagle3" else {}
    if (family, fmt) == ("medusa", "medusa"):
        hp["num_steps"] = 5  # FasterDecoding's loader builds exactly 5 heads
    head_path, head = head_dir(stories_target, family, **hp)
    if family == "eagle3":
        assert head.aux_layers == (2, 2, 2)
    if (family, fmt) == ("eagle3", "eagle"):
        with pytest.raises(ExportRefused, match="which repeat"):
            run_export(head_path, fmt, tmp_path / "out")
        return
    out = run_export(head_path, fmt, tmp_path / "out", check_tokens=32)
    meta = json.loads((out / "draftheads_export.json").read_text())
    assert meta["target"]["name"] == "stories260k" and meta["target"]["num_layers"] == 5
    assert meta["target"]["path"].endswith("stories260K-hf")
    assert meta["validation"]["probe_tokens"] == [2, 32] and max(meta["validation"]["max_abs_logit_diff"]) < 1e-4
    if family == "eagle3" and fmt != "sglang":
        assert meta["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    if fmt == "speculators":
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == meta["target"]["path"]
