"""The command line: files written, fields present, greedy output identical with and without a head, gamma=auto
recorded with its inputs, and one-line errors for bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from heads.errors import UserError
from serve.main import serve
from serve.prompts import load_prompts
from tests.serve.conftest import write_heads_and_prompts

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_target):
    return write_heads_and_prompts(tmp_path_factory.mktemp("serve"), tiny_target, ("eagle", "medusa"))


def cfg(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("serve", ["target=tiny-random", "progress=false", "max_new_tokens=10", *overrides])


def read(out):
    gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    return gens, json.loads((out / "bench.json").read_text())


def test_cli_writes_files_and_matches_vanilla(files, tmp_path, tiny_target):
    runs = {}
    for name, extra in (("vanilla", []), ("eagle", [f"head_path={files / 'eagle'}", "gamma=2"])):
        cmd = [sys.executable, "serve/main.py", "target=tiny-random", f"prompts={files / 'prompts.jsonl'}",
               "temperature=0", "max_new_tokens=12", "threads=1", f"hydra.run.dir={tmp_path / name}", *extra]
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=300, capture_output=True)
        runs[name] = read(tmp_path / name)
    (van, van_bench), (spec, spec_bench) = runs["vanilla"], runs["eagle"]
    assert [(g["question_id"], g["turn"]) for g in van] == [(1, 1), ("story", 1), (7, 1), (7, 2)]
    first, second = (tiny_target.tokenizer.decode(g["prompt_ids"]) for g in van[2:])
    # Spec-Bench's second turn is asked after the target's own first answer, in one conversation
    assert second.startswith(first) and van[2]["text"] in second and "And the sea?" in second[len(first):]
    for g in van + spec:
        assert set(g) >= {"question_id", "prompt_ids", "token_ids", "text"} and len(g["token_ids"]) <= 12
    assert [g["token_ids"] for g in spec] == [g["token_ids"] for g in van]  # greedy: the target's own tokens
    for bench in (van_bench, spec_bench):
        assert {"tokens_per_s", "tau_measured", "accept_rate_per_position", "target_passes", "settings"} <= set(bench)
    assert spec_bench["settings"]["gamma"] == 2 and spec_bench["settings"]["family"] == "eagle"
    assert van_bench["tau_measured"] == 1.0 and van_bench["settings"]["gamma"] == 0


def test_prompt_formats(files, tiny_target):
    prompts = load_prompts(files / "prompts.jsonl", tiny_target.tokenizer)
    tok = tiny_target.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                   tokenize=False)
    assert prompts[0]["prompt_ids"] == tok(chat, add_special_tokens=False).input_ids  # the reference answer is dropped
    assert prompts[1]["prompt_ids"] == tok("Once upon a time").input_ids  # raw text, no template
    assert "Why is the sky blue?" in tok.decode(prompts[2]["prompt_ids"]) and "sea" not in tok.decode(
        prompts[2]["prompt_ids"])  # Spec-Bench: first turn only
    assert prompts[2]["category"] == "qa" and prompts[2]["followups"] == []
    asked = load_prompts(files / "prompts.jsonl", tok, turns="all")
    assert [p["followups"] for p in asked] == [[], [], ["And the sea?"]]  # only Spec-Bench records have later turns
    assert [p["prompt_ids"] for p in asked] == [p["prompt_ids"] for p in prompts]
    with pytest.raises(UserError, match="turns='both'"):
        load_prompts(files / "prompts.jsonl", tok, turns="both")


def test_gamma_auto_records_choice(files, tmp_path):
    bench = serve(cfg(f"head_path={files / 'eagle' / 'head'}", f"prompts={files / 'prompts.jsonl'}", "gamma=auto",
                      "tree=dynamic"), tmp_path)
    choice = bench["auto"]
    assert choice["alpha"] == [0.6, 0.5, 0.4] and choice["acceptance_json"].endswith("acceptance.json")
    assert {"r", "c", "target_pass_1_s"} <= set(choice["costs"]) and len(choice["table"]) > 3
    assert set(choice["round_excess"]) == {"plain", "chain", "tree"} and len(choice["rounds_timed_s"]) == 3
    best = max(row["speedup_predicted"] for row in choice["table"])
    assert choice["predicted"]["speedup_predicted"] == best
    for key, value in choice["choice"].items():
        assert bench["settings"][key] == value


def test_gamma_auto_turns_a_useless_head_off(files, tmp_path, caplog):
    (tmp_path / "weak.json").write_text(json.dumps({"alpha": [0.01, 0.01, 0.01], "temperature": 0.0}))
    bench = serve(cfg(f"head_path={files / 'eagle'}", f"prompts={files / 'prompts.jsonl'}", "gamma=auto",
                      f"acceptance_path={tmp_path / 'weak.json'}"), tmp_path / "out")
    assert bench["auto"]["choice"] == {"gamma": 0} and bench["settings"]["gamma"] == 0
    assert bench["tau_measured"] == 1.0 and "decoding without speculation" in caplog.text


def test_gamma_adaptive_matches_vanilla(files, tmp_path):
    """Adaptive chains, and adaptive trees (gamma=adaptive tree=dynamic), through the CLI: vanilla's text."""
    prompts = f"prompts={files / 'prompts.jsonl'}"
    adaptive = serve(cfg(f"head_path={files / 'eagle'}", prompts, "gamma=adaptive"), tmp_path / "adaptive")
    vanilla = serve(cfg(prompts), tmp_path / "vanilla")
    assert adaptive["settings"]["adaptive"] and adaptive["auto"]["alpha"] == [0.6, 0.5, 0.4]
    assert sum(adaptive["rounds_per_draft_depth"]) == adaptive["target_passes"]
    read = lambda d: [json.loads(line)["token_ids"] for line in (d / "generations.jsonl").read_text().splitlines()]
    assert read(tmp_path / "adaptive") == read(tmp_path / "vanilla")  # greedy: the same text, any γ schedule
    trees = serve(cfg(f"head_path={files / 'eagle'}", prompts, "gamma=adaptive", "tree=dynamic"), tmp_path / "trees")
    assert trees["settings"]["tree"] == "dynamic" and trees["auto"]["alpha_source"].startswith("product")
    assert any(s.get("tree") == "dynamic" for s in trees["auto"]["settings"])
    assert sum(trees["adaptive_rounds"].values()) == trees["target_passes"]
    written = json.loads((tmp_path / "trees" / "bench.json").read_text())  # the file, not only the returned dict
    assert written["adaptive_rounds"] == trees["adaptive_rounds"]
    assert read(tmp_path / "trees") == read(tmp_path / "vanilla")


def test_static_tree_sampling_runs(files, tmp_path):
    bench = serve(cfg(f"head_path={files / 'medusa'}", f"prompts={files / 'prompts.jsonl'}", "gamma=3",
                      "tree=static", "temperature=1.0", "top_p=0.9"), tmp_path)
    assert bench["settings"]["tree"] == "static" and bench["target_passes"] > 0
    assert 0 < bench["new_tokens"] <= 40  # 4 turns (Spec-Bench's two) x 10 tokens; an EOS may stop one early
    # the counts a round leaves: depth i + 1 is reached exactly when depth i was kept, and τ is what they add up to
    reached, kept = bench["reached_per_position"], bench["accepted_per_position"]
    assert reached[0] == bench["target_passes"] and reached[1:] == kept[:-1] and kept[0] > 0, bench
    assert bench["accept_rate_per_position"] == pytest.approx([k / r if r else None for k, r in zip(kept, reached)])
    assert bench["tau_measured"] == pytest.approx(1 + sum(kept) / bench["target_passes"])


@pytest.mark.parametrize("overrides,message", [
    (["prompts=/nonexistent.jsonl"], "no such file"),
    (["gamma=3"], "need a draft head"),
    (["head_path={d}/eagle", "tree=static"], "Medusa"),
    (["head_path={d}/medusa", "gamma=9"], "exceeds"),
    (["head_path={d}/nothing"], "not a draftheads head"),
    (["prompts={d}/bad.jsonl"], "not valid JSON"),
])
def test_bad_input_is_one_clear_error(files, tmp_path, overrides, message):
    (files / "bad.jsonl").write_text('{"prompt": "ok"}\n{not json\n')
    overrides = [o.format(d=files) for o in overrides]
    if not any(o.startswith("prompts=") for o in overrides):
        overrides.append(f"prompts={files / 'prompts.jsonl'}")
    with pytest.raises(UserError, match=message):
        serve(cfg(*overrides), tmp_path)


@pytest.mark.slow  # a second interpreter start (imports take seconds); the error itself is tested in-process above
def test_cli_error_is_one_line(tmp_path):
    cmd = [sys.executable, "serve/main.py", "target=tiny-random", "prompts=/nonexistent.jsonl",
           f"hydra.run.dir={tmp_path}"]
    res = subprocess.run(cmd, cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: prompts=")
    assert "Traceback" not in res.stderr


@pytest.mark.shared
def test_spec_bench_subset(tiny_target):
    from heads.target import shared_dir

    path = shared_dir() / "data" / "eval" / "spec_bench" / "question.jsonl"
    prompts = load_prompts(path, tiny_target.tokenizer, per_category=2)
    cats = [p["category"] for p in prompts]
    assert sorted(set(cats)) == ["math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation"]
    assert all(cats.count(c) == 2 for c in set(cats))
