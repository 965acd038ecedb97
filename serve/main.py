"""Run the speculative-decoding runner over a prompt file and record what it did (Hydra; conf/serve.yaml).

    python serve/main.py target=smollm2-135m head_path=DIR prompts=FILE temperature=T max_new_tokens=N gamma=G \
        hydra.run.dir=OUT

No head_path: vanilla decoding through the same loop. Writes OUT/generations.jsonl (one line per answered turn:
question_id, turn, prompt_ids, token_ids, text; a Spec-Bench record's later turns are asked after each answer, as
Spec-Bench and train/'s held-out answers ask them, unless turns=first) and OUT/bench.json (tokens/s, τ measured,
acceptance per position, target passes, the settings, and with gamma=auto the choice and the α/cost inputs it came
from). gamma=auto may choose γ = 0 (plain decoding, the head unused) when no setting predicts a speedup;
gamma=adaptive re-chooses γ (with tree=static|dynamic: the tree among auto's candidates, chains and plain decoding
included) every round from the acceptance the request sees (serve/adaptive.py). ``serve(cfg)`` is a plain function;
``main`` turns bad input into one line on stderr.
"""
from __future__ import annotations

import json
import logging
import platform
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from heads.errors import UserError
from heads.target import load_target, shared_dir
from serve import auto, calibrate
from serve.prompts import check_unseen, load_prompts, measured_prompts, next_turn, stop_ids
from serve.adaptive import Adaptive
from serve.generate import Decoder, Sampling, Stats, generate
from serve.loading import load_draft_head, resolve_device
from serve.model import Transformer
from serve.setting import Setting
from serve.tree import MEDUSA_TREE, make_tree

log = logging.getLogger("serve")
OmegaConf.register_new_resolver("shared", lambda p="": str(shared_dir() / p), replace=True)


# -- setup -------------------------------------------------------------------------------------------------------

def drafting(cfg, head, head_dir, model, sampling: Sampling) -> tuple[Setting, dict | None, Adaptive | None]:
    """-> (the setting, the auto-choice record for bench.json or None, adaptive drafting's state or None)."""
    if head is None:
        if cfg.gamma not in ("auto", 0, None) or cfg.tree:
            raise UserError("gamma/tree need a draft head: pass head_path=DIR (or drop gamma/tree for vanilla)")
        return Setting.chain(0), None, None
    if cfg.tree not in (None, "static", "dynamic"):
        raise UserError(f"tree={cfg.tree}: choose null (chain), static or dynamic")
    if cfg.tree == "static" and head.family != "medusa":
        raise UserError(f"tree=static drafts with Medusa heads; this head is {head.family} (try tree=dynamic)")
    if cfg.tree == "dynamic" and head.family not in ("eagle", "eagle3"):
        raise UserError(f"tree=dynamic needs an eagle/eagle3 head; this head is {head.family}")
    if cfg.gamma not in ("auto", "adaptive"):
        if cfg.tree == "static":
            paths = [tuple(p) for p in cfg.tree_paths] if cfg.tree_paths else MEDUSA_TREE
            return Setting.static_tree([p for p in paths if len(p) <= head.max_draft_steps]), None, None
        if cfg.tree == "dynamic":
            return Setting.dynamic_tree(cfg.tree_depth, cfg.tree_top_k, cfg.tree_total_tokens), None, None
        try:
            gamma = int(cfg.gamma)
        except (TypeError, ValueError) as e:
            raise UserError(f"gamma={cfg.gamma}: an integer, auto or adaptive") from e
        return Setting.chain(gamma), None, None
    try:
        acc = auto.find_acceptance(head_dir, cfg.acceptance_path)
        read = auto.read_acceptance(acc, cfg.temperature)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    alphas = read["alpha"]
    log.info("gamma=%s: τ predicted from the %s in %s (T=%s)", cfg.gamma, read["source"], acc, read["temperature"])
    costs = auto.measure_costs(model, head, auto.sizes_for(head.max_draft_steps, alphas, cfg.tree))
    inputs = {"acceptance_json": str(acc), "alpha": alphas, "alpha_temperature": read["temperature"],
              "alpha_source": read["source"], "tau_chain": read["tau_chain"], "alpha_rank": read["ranks"],
              "costs": costs.to_json()}
    if cfg.gamma == "adaptive":
        settings = auto.candidates(head.family, head.max_draft_steps, alphas, cfg.tree)
        prior = alphas[: head.max_draft_steps] if head.max_draft_steps is not None else alphas
        adaptive = Adaptive(prior, costs, settings=settings, pass_s=costs.pass_s)
        record = {**inputs, "settings": [s.to_json() for s in settings], "prior": prior}
        return Setting.adaptive_over(cfg.tree), record, adaptive
    record = calibrate.choose(model, head, sampling, alphas, costs, cfg.tree, read["tau_chain"], read["ranks"])
    choice = record["choice"]
    record.update(inputs, choice=choice.to_json())
    log.info("gamma=auto chose %s (predicted speedup %.2fx from α=%s, c=%.3f; a round's excess over its passes, "
             "in passes: %s)", choice.to_json(paths=False), record["predicted"]["speedup_predicted"],
             [round(a, 3) for a in alphas], costs.draft_step,
             {k: round(v, 2) for k, v in record["round_excess"].items()})
    if choice.kind == "plain":
        log.warning("gamma=auto: no setting predicts more than 1x on this machine (best draft setting %.2fx): "
                    "decoding without speculation", max(row["speedup_predicted"] for row in record["table"][1:]))
    return choice, record, None


# -- the job -----------------------------------------------------------------------------------------------------

def serve(cfg: DictConfig, out_dir: str | Path) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = resolve_device(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    try:
        target = load_target(cfg.target.name, cfg.target.path, str(dtype).removeprefix("torch."), device,
                             cfg.target.get("chat_format"))
    except (FileNotFoundError, OSError, ValueError) as e:
        raise UserError(f"target {cfg.target.name}: {e}") from e
    model = Transformer.from_hf(target.model)
    if cfg.get("compile"):
        model.compile()
    head, head_dir = (None, None)
    if cfg.head_path:
        head, head_dir = load_draft_head(cfg.head_path, target, model, dtype)
    prompts = load_prompts(cfg.prompts, target.tokenizer, cfg.chat_template, cfg.per_category, cfg.limit,
                           cfg.get("split"), cfg.get("turns", "all"))
    if cfg.get("alpha_prompts"):
        prompts = measured_prompts(prompts, cfg.alpha_prompts, cfg.get("split"))
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    setting, choice, adaptive = drafting(cfg, head, head_dir, model, sampling)
    if choice is not None:  # a prediction from acceptance.json: say whether these prompts are the text it came from
        try:
            choice["prompts_unseen_by_alpha"] = check_unseen(prompts, Path(choice["acceptance_json"]))
        except UserError as e:  # serving may decode anything; a benchmark (python -m bench) refuses instead
            log.warning("%s", e)
            choice["prompts_unseen_by_alpha"] = "overlap"
    run_head = None if setting.kind == "plain" else head  # plain decoding needs no commits
    tree = None if adaptive else make_tree(setting, device)  # adaptive builds its own candidates' trees
    try:
        dec = Decoder(model, run_head, sampling, gamma=setting.gamma, tree=tree, seed=cfg.seed,
                      adaptive=adaptive)
    except ValueError as e:
        raise UserError(str(e)) from e
    stops = stop_ids(target.tokenizer, target.model.config) if cfg.stop_at_eos else set()

    from tqdm import tqdm

    if cfg.get("compile"):  # compile the pass shapes before the clock runs (minutes on a small CPU): two prompts,
        # so that the decode position is traced as dynamic too; their state is reset by the next generate()
        log.info("compile=true: compiling the target's passes on %d warm-up requests (not timed)", min(2, len(prompts)))
        for p in prompts[:2]:
            generate(dec, torch.tensor(p["prompt_ids"], device=device), min(16, cfg.max_new_tokens), stops)
    total, rounds = Stats(), defaultdict(int)  # rounds per adaptive setting
    every_stop = stop_ids(target.tokenizer, target.model.config)  # what ends an answer fed back as a turn
    with open(out / "generations.jsonl", "w") as f:
        for i, p in enumerate(tqdm(prompts, desc="prompts", disable=not cfg.progress)):
            dec.generator.manual_seed(cfg.seed + i)
            messages, prompt_ids = p["messages"], p["prompt_ids"]
            for turn in range(1 + len(p["followups"])):
                if turn:  # a later turn: the conversation so far, this answer included, rendered again
                    messages, prompt_ids = next_turn(messages, tokens, p["followups"][turn - 1], target.tokenizer,
                                                     every_stop)
                tokens, stats = generate(dec, torch.tensor(prompt_ids, device=device), cfg.max_new_tokens, stops)
                total.merge(stats)
                for index in dec.trace:
                    rounds[index] += 1
                f.write(json.dumps({"question_id": p["question_id"], "category": p["category"], "turn": turn + 1,
                                    "prompt_ids": prompt_ids, "token_ids": tokens,
                                    "text": target.tokenizer.decode(tokens, skip_special_tokens=True)}) + "\n")
    bench = {
        **total.summary(),
        "settings": {
            "target": cfg.target.name, "head_path": str(head_dir) if head_dir else None,
            "family": head.family if head is not None else None, "temperature": cfg.temperature,
            "top_k": cfg.top_k, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
            "prompts": str(cfg.prompts), "num_prompts": len(prompts), "device": device,
            "dtype": str(dtype).removeprefix("torch."),
            **setting.to_json(),
        },
        "auto": choice,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name() if device == "cuda" else None},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if adaptive is not None:
        bench["adaptive_rounds"] = {adaptive.settings[i].describe(): n for i, n in sorted(rounds.items())}
    (out / "bench.json").write_text(json.dumps(bench, indent=2))  # last: the file holds everything returned
    log.info("%d prompts, %d tokens, %.1f tokens/s, tau %.2f, %d target passes -> %s", len(prompts),
             bench["new_tokens"], bench["tokens_per_s"], bench["tau_measured"], bench["target_passes"], out)
    return bench


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        serve(cfg, HydraConfig.get().runtime.output_dir)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
