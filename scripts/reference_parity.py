"""Our EAGLE-3 trainer side by side with SafeAILab's reference trainer, on the same text, tokens and seed.

    python scripts/reference_parity.py --tokens 200000 --out DIR

1. The text: reference answers of ../shared/data/train (records with an assistant turn, none of Spec-Bench's
   prompts), a seeded shuffle, whole records of at most --max-len tokens, until --tokens trained (answer) tokens,
   in a multiple of 8 records (our recipe's batch; the reference's 2 micro-batches divide it): DIR/train.jsonl.
   Both trainers read that file and train one pass over it.
2. Ours: the recipe (experiment=smollm2-eagle3: 3 steps, 8k draft vocabulary, lr 2e-3, batch 8, the disk feature
   cache; plain EAGLE-3, without the recipe's EAGLE 3.1 norms, which the eagle layout cannot carry) on that file
   only (no distilled answers), one epoch, no mid-run held-out checks (the last head is kept, as the reference's
   is), in DIR/ours-run; exported with format=eagle to DIR/ours. Its seconds are the feature pass (timed from its
   log) plus its training steps: the reference runs the target inside each step.
3. The reference: scripts/engines/eagle3_ref_train.py in the eagle_ref venv (scripts/engine_env.sh eagle_ref) runs
   SafeAILab's traineagle3 (cnets.Model, 7-step training-time test, 0.8^k, scandata vocabulary, ds_config's AdamW,
   clipping, accumulation and schedule); that file's docstring lists what was replaced and why. Its lr schedule
   (log warm-up over 12k steps, linear decay to 0 at 800k) is scaled to the run's optimizer steps, keeping its
   peak 5e-5 (--reference-lr overrides the peak): at 200k tokens (~1k steps) the unscaled one stays in warm-up.
   Written in the same ``eagle`` layout to DIR/reference.
4. The two texts are compared token for token (ids and trained tokens, and the trained-token counts each trainer
   reports); a run whose heads saw different text is refused. Both heads are measured with train/acceptance.py
   (``train/main.py mode=eval``) on the same held-out greedy answers (Spec-Bench's test split: 52 prompts).
5. DIR/parity.json: per head α per position, τ(γ=3), trained tokens, training seconds, tokens/s; the CPU,
   the commit, the settings. Both trainers run at the same time with --threads each (default 1: equal
   conditions on a shared 2-core machine).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from heads.target import engine_venvs, load_target, shared_dir  # noqa: E402

BATCH = 8  # the recipe's data.batch_size; the reference trains micro-batches of 1, two per optimizer step
GAMMA = 3


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def git_commit() -> str:
    """HEAD (+dirty when train/, heads/ or these scripts differ from it); a `git archive` copy of the tree (a
    stable source while others edit the checkout) names its commit in ROOT/.commit."""
    if (ROOT / ".commit").exists():
        return (ROOT / ".commit").read_text().strip() + " (git archive)"
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "train", "heads", "scripts/reference_parity.py",
                            "scripts/engines/eagle3_ref_train.py"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def text_digest(examples) -> tuple[str, int]:
    """sha256 of (ids, trained flags) per sequence, as eagle3_ref_train.sequence_digest computes it, from our
    Examples (loss_mask[t] = token t+1 trained); and the trained-token count."""
    import torch

    h, tokens = hashlib.sha256(), 0
    for ex in examples:
        trained = torch.zeros(len(ex.input_ids), dtype=torch.uint8)
        trained[1:] = ex.loss_mask[:-1].to(torch.uint8)
        h.update(ex.input_ids.to(torch.int64).numpy().tobytes())
        h.update(trained.numpy().tobytes())
        h.update(b"|")
        tokens += int(ex.loss_mask.sum())
    return h.hexdigest(), tokens


def select_text(target, tokens: int, max_len: int, seed: int, out: Path) -> dict:
    """Whole reference-answer records until ``tokens`` trained tokens, in a multiple of BATCH records."""
    from train.data import chat_example
    from heads.records import read_sources

    heldout = {r.key() for r in read_sources([str(shared_dir() / "data/eval/spec_bench/question.jsonl")])}
    records = [r for r in read_sources([str(shared_dir() / "data/train/*.jsonl")])
               if not r.needs_answer and r.key() not in heldout]
    random.Random(seed).shuffle(records)
    chosen, examples, total = [], [], 0
    for r in records:
        ex = chat_example(r.messages, target.tokenizer, max_len + 1, r.where)
        if len(ex.input_ids) > max_len or not ex.loss_mask.any():
            continue  # neither trainer may truncate (ours) or drop (the reference) a record
        chosen.append(r)
        examples.append(ex)
        total += int(ex.loss_mask.sum())
        if total >= tokens and len(chosen) % BATCH == 0:
            break
    else:
        fail(f"../shared/data/train has only {total} trainable tokens in records of <= {max_len} tokens; "
             f"lower --tokens")
    with open(out / "train.jsonl", "w") as f:
        for r in chosen:
            f.write(json.dumps({"where": r.where, "messages": r.messages}) + "\n")
    digest, trained = text_digest(examples)
    return {"records": len(chosen), "trained_tokens": trained, "sequence_tokens": sum(len(e.input_ids) for e in
            examples), "sha256": digest, "file": str(out / "train.jsonl")}


def client_target(src: Path, out: Path) -> Path:
    """The target folder as transformers 4.53 and SafeAILab's code read it: the same weights, plus
    model.safetensors.index.json (cnets finds the embedding through it) and a tokenizer_config 4.x opens."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        if (src / name).exists() and not (out / name).exists():
            (out / name).symlink_to(src / name)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok = {k: v for k, v in tok.items() if k not in ("extra_special_tokens", "backend")}
    if (src / "chat_template.jinja").exists():
        tok["chat_template"] = (src / "chat_template.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps({**tok, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def eagle_ref_venv() -> Path:
    venv = engine_venvs() / "eagle_ref"
    if not (venv / ".stamp").exists():
        fail(f"no eagle_ref venv at {venv}; build it with: bash scripts/engine_env.sh eagle_ref")
    return venv


def thread_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def ours_command(args, text: dict, run: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train/main.py"), "experiment=smollm2-eagle3", f"seed={args.seed}",
            "distill_first=false", "data.train_files=[]", f"data.reference_files=[{text['file']}]",
            "data.max_reference_records=null", f"data.max_len={args.max_len}",
            f"head.hparams.draft_vocab_size={args.draft_vocab}", f"trainer.max_steps={text['records'] // BATCH}",
            # EAGLE-3 as the reference trains it: SmolLM2's default EAGLE 3.1 norms have no place in the eagle layout
            "head.hparams.fc_norm=false", "head.hparams.norm_output=false",
            "trainer.precision=32-true",  # the recipe trains in bf16 where the CPU has it; the reference runs fp32
            "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "eval.extra_temperatures=[]",
            "data.max_eval_records=1",  # its own closing α is not the figure (measure() is): 2 prompts, not 104
            f"data.feature_dir={run / 'features'}", f"hydra.run.dir={run}", *args.eval_override,
            *args.ours_override]


def reference_command(args, text: dict, target_dir: Path, run: Path) -> list[str]:
    cfg = {"src": str(shared_dir() / "clients" / "SafeAILab-EAGLE-cb7e084"), "target": str(target_dir),
           "records": text["file"], "out": str(run), "seed": args.seed, "draft_vocab_size": args.draft_vocab,
           "max_len": args.max_len, "lr": args.reference_lr, "warmup_steps": None, "threads": args.threads}
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps(cfg, indent=1))
    return [str(eagle_ref_venv() / "bin/python"), str(ROOT / "scripts/engines/eagle3_ref_train.py"),
            str(run / "config.json")]


def log_seconds(log: str, start: str, end: str) -> float:
    """Seconds between the first log lines matching ``start`` and ``end`` (Hydra's [YYYY-mm-dd HH:MM:SS,ms])."""
    stamps = []
    for pattern in (start, end):
        m = re.search(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\][^\n]*" + pattern, log, re.M)
        if not m:
            fail(f"our trainer's log has no line matching {pattern!r}; its log format changed")
        stamps.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    return (stamps[1] - stamps[0]).total_seconds()


def ours_result(run: Path) -> dict:
    record = json.loads((run / "acceptance.json").read_text())
    log = (run / "train.log").read_text()
    features = log_seconds(log, r"\] - data [^\n]* train sequences", r"\] - feature cache .*shards \(")
    built = record.get("feature_cache", {}).get("shards_built")
    if not built:
        fail(f"our run reused a feature cache ({record.get('feature_cache')}): its feature pass was not timed; "
             f"delete {run} and rerun")
    steps = record["trained_tokens"] / record["trained_tokens_per_s"]
    seconds = features + steps
    return {"trained_tokens": record["trained_tokens"], "train_seconds": round(seconds, 1),
            "tokens_per_s": round(record["trained_tokens"] / seconds, 1), "feature_pass_seconds": round(features, 1),
            "step_seconds": round(steps, 1), "train_steps": record["train_steps"]}


def run_logged(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[parity] {' '.join(cmd)}\n[parity]   log: {log}", flush=True)
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def wait(proc: subprocess.Popen, name: str, log: Path) -> None:
    if proc.wait() != 0:
        tail = log.read_text()[-3000:]
        fail(f"{name} training failed (rc {proc.returncode}); see {log}:\n{tail}")


def train_both(args, text: dict, out: Path) -> tuple[dict, dict]:
    from heads.target import resolve_path

    target_dir = client_target(Path(resolve_path("smollm2-135m", None)), out / "target")
    env = thread_env(args.threads)
    ours_run, ref_run = out / "ours-run", out / "reference-run"
    for d in (ours_run, ref_run):
        if d.exists():
            fail(f"{d} exists: a fresh run times a fresh feature pass; remove it or pick another --out")
    ref_cmd = reference_command(args, text, target_dir, ref_run)
    procs = [("ours", run_logged(ours_command(args, text, ours_run), ours_run / "train.log", env), ours_run),
             ("reference", run_logged(ref_cmd, ref_run / "train.log", {**env, "PYTHONPATH": ""}), ref_run)]
    for name, proc, run in procs:
        wait(proc, name, run / "train.log")
    return finished(text, out)


def finished(text: dict, out: Path) -> tuple[dict, dict]:
    ours, ref = ours_result(out / "ours-run"), json.loads((out / "reference-run/train.json").read_text())
    check_same_text(text, ours, ref)
    return ours, ref


def check_same_text(text: dict, ours: dict, ref: dict) -> None:
    """Refuse to compare heads that saw different text: the reference's token-for-token digest (ids and trained
    tokens) must be the selection's (computed with train/data.py, what ours tokenises with), and both trainers'
    trained-token counts the selection's."""
    if ref["data_sha256"] != text["sha256"] or {ours["trained_tokens"], ref["trained_tokens"]} != \
            {text["trained_tokens"]}:
        fail(f"the two heads saw different text (sha256 selected {text['sha256'][:12]} / reference "
             f"{ref['data_sha256'][:12]}; trained tokens selected {text['trained_tokens']} / ours "
             f"{ours['trained_tokens']} / reference {ref['trained_tokens']}): refusing to compare them")


def export_heads(target, out: Path, args) -> None:
    import torch

    from export.common import llama_config

    proc = subprocess.run([sys.executable, str(ROOT / "export/main.py"), f"head_path={out / 'ours-run/head'}",
                           "format=eagle", f"out={out / 'ours'}", f"target_path={out / 'target'}"],
                          capture_output=True, text=True, cwd=ROOT, env=thread_env(args.threads))
    if proc.returncode != 0:
        fail(f"exporting our head failed:\n{proc.stderr[-3000:]}")
    ref = out / "reference"
    ref.mkdir(exist_ok=True)
    (ref / "model.safetensors").write_bytes((out / "reference-run/model.safetensors").read_bytes())
    config = llama_config(target.dims, torch.float32, bias=False, rope_scaling=None, pretraining_tp=1,
                          architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=args.draft_vocab)
    (ref / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def imported(layout_dir: Path, out: Path, target) -> Path:
    """An ``eagle``-layout head read back as our head (heads/layouts.py, what init_from=DIR uses), saved native:
    both heads reach train/acceptance.py through the same reader. K = GAMMA positions are measured."""
    from heads import build_head
    from heads.checkpoint import save_head
    from heads.layouts import read_state

    cfg = json.loads((layout_dir / "config.json").read_text())
    head = build_head("eagle3", target.dims, num_steps=GAMMA, draft_vocab_size=cfg["draft_vocab_size"])
    head.attach_target(target)
    try:
        head.load_state_dict(read_state(layout_dir, head, target.identity()))
    except (OSError, ValueError) as e:
        fail(f"reading {layout_dir} as our head: {e}")
    return save_head(head, out, target.identity(), extra={"imported_from": str(layout_dir)})


def measure(head_dir: Path, run: Path, args) -> dict:
    """α per position and τ(γ=3) on the test split of the held-out greedy answers (train/acceptance.py through
    ``train/main.py mode=eval``, which measures validation and test; test is the figure: nothing was tuned on it)."""
    cmd = [sys.executable, str(ROOT / "train/main.py"), "mode=eval", "experiment=smollm2-eagle3",
           f"head_path={head_dir}", "eval.extra_temperatures=[]", f"hydra.run.dir={run}",
           *args.eval_override]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=thread_env(args.threads))
    if proc.returncode != 0:
        fail(f"measuring {head_dir} failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    record = json.loads((run / "acceptance.json").read_text())
    test = record["test"]
    return {"alpha": [round(a, 4) for a in test["alpha"]], "tau": round(test["tau_predicted"][str(GAMMA)], 4),
            "heldout_tokens": test["num_tokens"], "alpha_validation": [round(a, 4) for a in record["alpha"]],
            "heldout": "Spec-Bench test split (heads/splits.py), the target's greedy answers, T = 0",
            "command": " ".join(["python", *cmd[1:]])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200_000, help="trained (answer) tokens for each head")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab", type=int, default=8192, help="both heads' draft vocabulary (the recipe's 8k)")
    p.add_argument("--max-len", type=int, default=512, help="the recipe's data.max_len; longer records are skipped")
    p.add_argument("--threads", type=int, default=1, help="torch threads for each trainer (they run at once)")
    p.add_argument("--reference-lr", type=float, default=None, help="the reference's peak lr (default ds_config's)")
    p.add_argument("--ours-override", nargs="*", default=[], help="extra Hydra overrides for our run")
    p.add_argument("--eval-override", nargs="*", default=[], help="extra Hydra overrides for every α measurement "
                   "(the test: data.max_eval_records=2)")
    p.add_argument("--measure-only", action="store_true", help="measure the heads an earlier run left in --out")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    target = load_target("smollm2-135m")
    if args.measure_only:  # the heads of an earlier run in DIR, measured again (e.g. after a fix in train/)
        text = json.loads((out / "text.json").read_text())
        ours, ref = finished(text, out)
    else:
        text = select_text(target, args.tokens, args.max_len, args.seed, out)
        (out / "text.json").write_text(json.dumps(text, indent=1))
        print(f"[parity] text: {text['records']} records, {text['trained_tokens']} trained tokens", flush=True)
        ours, ref = train_both(args, text, out)
    export_heads(target, out, args)
    heads = {name: imported(out / name, out / f"{name}-eval" / "head", target) for name in ("ours", "reference")}
    result = {"ours": {**measure(heads["ours"], out / "ours-eval", args), **ours},
              "reference": {**measure(heads["reference"], out / "reference-eval", args),
                            **{k: ref[k] for k in ("trained_tokens", "train_seconds", "tokens_per_s")},
                            "optimizer_steps": ref["optimizer_steps"], "lr": ref["lr"], "versions": ref["versions"]}}
    result.update(
        machine={"cpu": cpu_name(), "cores": os.cpu_count(), "threads_per_trainer": args.threads,
                 "trainers": "ran at the same time", "load_average_after": os.getloadavg(),
                 "reference_load_average": ref["load_average"]},
        commit=git_commit(), date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), wall_seconds=round(time.time() - started),
        text=text, settings={"seed": args.seed, "draft_vocab_size": args.draft_vocab, "max_len": args.max_len,
                             "gamma": GAMMA, "ours": "experiment=smollm2-eagle3 (3 steps, lr 2e-3 cosine, batch 8, "
                             "disk feature cache), one epoch, no mid-run checks: " + " ".join(
                                 ours_command(args, text, out / "ours-run")[2:]),
                             "reference": "SafeAILab traineagle3 cnets.Model (7 TTT steps, 0.8^k), AdamW betas "
                             "(0.9, 0.95), clip 0.5, micro-batch 1 x 2 accumulation, WarmupDecayLR scaled to the "
                             "run; replacements: scripts/engines/eagle3_ref_train.py"})
    (out / "parity.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: {x: result[k][x] for x in ("alpha", "tau", "trained_tokens", "tokens_per_s")}
                      for k in ("ours", "reference")}, indent=1))


if __name__ == "__main__":
    main()
