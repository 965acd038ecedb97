"""Train a draft head on a frozen target and measure its acceptance α on held-out data (Hydra + Lightning).

    python train/main.py                                  # EAGLE-3 on SmolLM2-135M, self-distilled data, CPU
    python train/main.py head=eagle target=llama2-7b      # with a GPU and the weights (add trainer=ddp for many)
    python train/main.py mode=eval head_path=DIR/head target=smollm2-135m data.eval_files=[FILE] hydra.run.dir=DIR2
    python train/main.py mode=distill distill.max_records=2000  # the target answers data/train once, in shards

Outputs land in the Hydra run directory (``hydra.run.dir=DIR``): ``acceptance.json`` (α per draft position, trained
and untrained, predicted τ), ``head/`` (the native head: config.json + model.safetensors), ``checkpoints/last.ckpt``
(Lightning, for ``resume=true``), ``alpha.png`` and the logger's files (W&B offline by default).
``run(cfg)`` is a plain function (tests call it with a composed config): it converts the config once (``Job``) and
dispatches on ``mode`` to ``train`` (``fit``, then ``measure_and_save``), ``evaluate_saved`` or ``distill_step``;
``main`` wraps it for the command line and turns ``UserError`` into one line that says what to fix.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from heads import build_head
from heads.base import DraftHead
from heads.checkpoint import check_target, load_head, save_head
from heads.chat import MissingChatTemplate
from heads.target import Target, load_target, shared_dir
from train import UserError
from train.trainer import build_trainer, resolve_hardware

if TYPE_CHECKING:  # imported for real inside the functions that use them (see below)
    import lightning as L

    from train.budget import BudgetConfig, TimeBudget
    from train.data import DataConfig, DraftDataModule
    from train.module import DraftModule, EvalConfig, LossConfig, OptimConfig
    from train.regenerate import RegenConfig
    from train.selection import BestHead

# Lightning, the data pipeline and matplotlib load inside the functions that use them, so `--cfg job` and
# `--help` answer in a second or two instead of paying for those imports.

log = logging.getLogger("train")
OmegaConf.register_new_resolver("shared", lambda p="": str(shared_dir() / p), replace=True)  # ${shared:data/x}
MODES = ("train", "eval", "distill")


@dataclass
class Job:
    """The Hydra config converted once into the typed configs the pipeline reads; ``cfg`` keeps the rest (target,
    head, trainer, logger and the top-level keys), which Hydra and Lightning read as they are."""

    cfg: DictConfig
    out: Path
    data: DataConfig
    distill: RegenConfig
    loss: LossConfig
    optim: OptimConfig
    eval: EvalConfig
    budget: BudgetConfig
    started: float  # time.monotonic() when the job began: budget.minutes counts from here

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> "Job":
        from train.budget import BudgetConfig
        from train.data import DataConfig
        from train.module import EvalConfig, LossConfig, OptimConfig
        from train.regenerate import RegenConfig

        plain = lambda node: OmegaConf.to_container(node, resolve=True)
        deepspeed = "deepspeed" in str(cfg.trainer.get("strategy"))
        if cfg.optim.get("name") == "auto":  # Muon, measured to win for every family: EAGLE-3 +0.027 α₁ at equal
            # CPU (docs/results/levers.md); in their recipes at 941k trained tokens MTP +0.115 validation α₁,
            # EAGLE-1 +0.025 and Medusa +0.006 test α₁ (docs/results/training-and-scaling.md). DeepSpeed cannot run it
            cfg.optim.name = "adamw" if deepspeed else "muon"
        if cfg.optim.get("name") == "muon" and deepspeed:
            raise UserError("optim.name=muon does not run under DeepSpeed (ZeRO hands the optimizer flat shards, not "
                            "matrices); use trainer=ddp or optim.name=adamw")
        return cls(cfg, Path(cfg.out_dir), DataConfig.from_dict(plain(cfg.data)), RegenConfig(**plain(cfg.distill)),
                   LossConfig(**plain(cfg.head.loss)), OptimConfig(**plain(cfg.optim)), EvalConfig(**plain(cfg.eval)),
                   BudgetConfig(**plain(cfg.get("budget") or {})), time.monotonic())


def make_head(cfg: DictConfig, target: Target, state: dict | None = None) -> DraftHead:
    """Build the configured head for this target; ``state``: load these weights, else call ``init_head`` next."""
    hp = OmegaConf.to_container(cfg.head.hparams, resolve=True) or {}
    try:
        head = build_head(cfg.head.name, target.dims, **hp)
    except (ValueError, TypeError) as e:
        raise UserError(f"head {cfg.head.name} does not fit target {target.name}: {e}; fix head.hparams "
                        f"(e.g. head.hparams.aux_layers=null picks layers that fit) or choose another target") from e
    head.attach_target(target)
    if state is not None:
        head.load_state_dict(state)
    return head


def init_head(head: DraftHead, token_counts: torch.Tensor) -> None:
    if hasattr(head, "set_vocab_map"):
        head.set_vocab_map(token_counts)  # EAGLE-3: the draft vocabulary is the training data's frequent tokens
    head.init_from_target()


def checkpoint_to_resume(cfg: DictConfig, out: Path) -> str | None:
    path = cfg.get("ckpt_path") or (out / "checkpoints" / "last.ckpt" if cfg.get("resume") else None)
    if path is None:
        return None
    path = Path(path)
    if not path.exists():
        raise UserError(f"no checkpoint at {path}; run without resume=true, or pass ckpt_path=FILE")
    if path.is_dir():  # DeepSpeed writes a directory of shards; its engine validates them on load
        return str(path)
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}); delete it or pass another ckpt_path=") from e
    return str(path)


def prepare_data(data, *args) -> None:
    try:
        data.prepare(*args)
    except MissingChatTemplate as e:
        raise UserError(str(e)) from e


def eval_temperatures(e: EvalConfig) -> list[float]:
    """The main evaluation temperature first, then the extra ones (each measured on its own held-out text)."""
    return list(dict.fromkeys([float(e.temperature)] + [float(t) for t in e.extra_temperatures]))


def data_description(cfg, data) -> dict:
    heldout = list(cfg.eval_files) or [f"held-out {cfg.heldout_fraction:.0%} of {list(cfg.train_files)}"]
    return {"config": cfg.name, "files": heldout, "sequences": len(data.eval_examples),
            "split": "heads/splits.py: within each category in file order, even ranks validation, odd ranks test"}


def evaluate_saved(job: Job, target: Target) -> dict:
    """mode=eval: α of a saved head on held-out files, written to OUT/acceptance.json."""
    from train.acceptance import acceptance_record, measure_sets, with_test_split, write_json
    from train.data import DraftDataModule

    cfg = job.cfg
    if not cfg.get("head_path"):
        raise UserError("mode=eval needs head_path=DIR/head (the head/ directory a training run wrote)")
    try:
        head, config = load_head(cfg.head_path)
        check_target(config, target.identity())
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    head.attach_target(target)
    data = DraftDataModule(job.data, target, cfg.seed, mode="eval")
    e, temps = job.eval, eval_temperatures(job.eval)
    prepare_data(data, (), temps, e.top_p)
    measured = measure_sets({"head": head}, target, data.eval_loaders("validation"), e.top_k, e.top_p)
    record = acceptance_record(config["family"], target.name, data_description(job.data, data), temps[0],
                               measured["head"], top_k=e.top_k, top_p=e.top_p, texts=data.eval_text)
    tested = measure_sets({"head": head}, target, data.eval_loaders("test"), e.top_k, e.top_p)
    with_test_split(record, tested["head"], data.heldout_keys)
    record["head_path"] = str(cfg.head_path)
    write_json(job.out / "acceptance.json", record)
    return record


def distill_step(job: Job, target: Target) -> dict:
    """mode=distill: the target answers distill.files into resumable shards (train/regenerate.py)."""
    from train.acceptance import write_json
    from train.regenerate import regenerate

    write_json(job.out / "summary.json", regenerate(job.distill, target))
    return {}


def run(cfg: DictConfig) -> dict:
    """Run the job described by ``cfg`` (mode=train | eval | distill); returns the acceptance record (also written
    to OUT/acceptance.json), {} for distill and on every rank but the first."""
    import lightning as L

    if cfg.mode not in MODES:
        raise UserError(f"mode={cfg.mode!r}; choose train, eval or distill")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    job = Job.from_cfg(cfg)
    job.out.mkdir(parents=True, exist_ok=True)
    device, dtype = resolve_hardware(cfg)
    try:
        target = load_target(cfg.target.name, cfg.target.path, dtype, device, cfg.target.get("chat_format"))
    except (FileNotFoundError, OSError, ValueError) as e:
        raise UserError(f"cannot load target {cfg.target.name}: {str(e).splitlines()[0]}") from e
    return {"train": train, "eval": evaluate_saved, "distill": distill_step}[cfg.mode](job, target)


@dataclass
class Fitted:
    """What ``fit`` leaves for ``measure_and_save``."""

    head: DraftHead  # the last step's, whole fp32 weights under any strategy
    init_state: dict  # the untrained head's state dict: the baseline α
    data: DraftDataModule
    module: DraftModule
    trainer: L.Trainer
    keeper: BestHead  # holds the best mid-run check's head
    fit_ended: float  # time.monotonic() when trainer.fit returned
    budget: TimeBudget | None = None  # with budget.minutes: how it sized the run
    precision_probe: dict | None = None  # with trainer.precision=bf16-if-faster: the timed steps and the choice


def train(job: Job, target: Target) -> dict:
    """mode=train: fit a head, then measure it and save the one kept."""
    fitted = fit(job, target)
    return measure_and_save(job, target, fitted) if fitted.trainer.is_global_zero else {}


def fit(job: Job, target: Target) -> Fitted:
    """Prepare the data (answered by the target first with distill_first), build and initialise the head, train it."""
    from lightning import seed_everything

    from train.data import DraftDataModule
    from train.module import DraftModule
    from train.selection import BEST_BY, BestHead

    cfg = job.cfg
    ckpt_path = checkpoint_to_resume(cfg, job.out)
    t0 = time.perf_counter()
    if cfg.get("distill_first"):  # a recipe: the target answers distill.files first (resumable, reused)
        from train.regenerate import regenerate

        answers = regenerate(job.distill, target)
        job.data.train_files = [d["files"] for d in answers["datasets"].values()]
    # Seeded again: the stages since the first seeding (converting the target, answering prompts) run only on a cold
    # cache, and the same command must train the same head from an empty cache as from a warm one, whatever they draw.
    seed_everything(cfg.seed, workers=True, verbose=False)
    head = make_head(cfg, target)  # first: its feature layers decide what the data pass keeps
    data = DraftDataModule(job.data, target, cfg.seed)
    prepare_data(data, head.feature_layers, eval_temperatures(job.eval), job.eval.top_p)
    init_head(head, data.token_counts())
    if cfg.get("init_from"):  # fine-tune a saved head: native, SafeAILab EAGLE or FasterDecoding Medusa layout
        from heads.layouts import read_state

        try:
            head.load_state_dict(read_state(cfg.init_from, head, target.identity()))
        except (OSError, ValueError) as e:
            raise UserError(f"init_from={cfg.init_from}: {e}") from e
    if job.data.cache_features:
        data.cache_features(head.feature_layers)
    log.info("data ready in %.0f s", time.perf_counter() - t0)
    init_state = {k: v.detach().clone() for k, v in head.state_dict().items()}  # the untrained baseline
    if job.eval.best_by not in BEST_BY:
        raise UserError(f"eval.best_by={job.eval.best_by!r}; choose {' or '.join(BEST_BY)}")
    module = DraftModule(head, target, job.loss, job.optim, job.eval)
    keeper = BestHead(job.out / "checkpoints", job.eval.best_by, target.identity(), resume=ckpt_path is not None)
    probe = None
    if cfg.trainer.precision == "bf16-if-faster":  # a CPU with bf16 units, one process (train/trainer.py)
        from itertools import islice

        from train.precision import fastest_precision

        batches = list(islice(data.train_dataloader(), 3))  # epoch 0's first batches; training's loader is its own
        probe = fastest_precision(module, batches, keep_memory=bool(cfg.get("keep_freed_memory")))
        cfg.trainer.precision = probe["precision"]
    callbacks = [keeper]
    budget = None
    if job.budget.minutes is not None:
        from train.budget import TimeBudget

        budget = TimeBudget(job.budget, job.started + 60 * job.budget.minutes)
        callbacks.append(budget)
    trainer = build_trainer(cfg, job.out, callbacks)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    log.info("trained %d steps in %.0f s (%d trained tokens, %.0f tokens/s in training steps)", trainer.global_step,
             time.perf_counter() - t0, module.trained_tokens, module.trained_tokens / max(module.train_seconds, 1e-9))
    from train.strategies import consolidated_head  # lazy: imports Lightning's DeepSpeed strategy

    last = consolidated_head(trainer, module.head)  # every rank must call
    return Fitted(last, init_state, data, module, trainer, keeper, time.monotonic(), budget, probe)


def measure_and_save(job: Job, target: Target, fitted: Fitted) -> dict:
    """α of the last, the untrained and the best mid-run head on validation; the kept head's on test too. Writes
    OUT/head (the kept head), OUT/acceptance.json and OUT/alpha.png."""
    from train.acceptance import (acceptance_record, add_vocab_coverage, measure_sets, plot_alpha, with_test_split,
                                  write_json)
    from train.selection import final_choice

    cfg, out, ecfg, data, keeper, trainer = job.cfg, job.out, job.eval, fitted.data, fitted.keeper, fitted.trainer
    t0, step, T = time.perf_counter(), trainer.global_step, float(ecfg.temperature)
    train_info = {"data": job.data.name, "steps": step, "loss": asdict(job.loss)}
    save_head(fitted.head, out / "head", target.identity(), extra={"train": train_info})  # kept if what follows fails
    heads = {"last": fitted.head, "untrained": make_head(cfg, target, state=fitted.init_state)}
    best = keeper.best()
    if best is not None and best[1]["step"] != step:  # the best mid-run check's head, measured beside the last
        best[0].attach_target(target)
        heads["best"] = best[0]
    measured = measure_sets(heads, target, data.eval_loaders("validation"), ecfg.top_k, ecfg.top_p)
    chosen = final_choice(measured, T, ecfg.best_by)  # on validation: the test split below never picks anything
    head_step = best[1]["step"] if chosen == "best" else step
    record = acceptance_record(cfg.head.name, target.name, data_description(job.data, data), T, measured[chosen],
                               measured["untrained"], ecfg.top_k, ecfg.top_p, data.eval_text)
    tested = measure_sets({chosen: heads[chosen]}, target, data.eval_loaders("test"), ecfg.top_k, ecfg.top_p)
    with_test_split(record, tested[chosen], data.heldout_keys)
    add_vocab_coverage(record, heads[chosen], data.eval_sets)  # the α ceiling the draft vocabulary sets
    record.update(train_steps=step, head_step=head_step, selected_by=ecfg.best_by, alpha_last=measured["last"][T]["alpha"],
                  tau_predicted_last=measured["last"][T]["tau_predicted"], heldout_checks=keeper.state["history"])
    check = next((c for c in keeper.state["history"] if c["step"] == head_step), None)
    if check is not None:  # the kept head checked mid-run (from cached features: bf16 with features_on_disk) against
        # its final α here (the target's own pass, in its dtype): how far a mid-run α may be off
        record["midrun_alpha_gap"] = [float(a - c) for a, c in zip(record["alpha"], check["alpha"])]
    module = fitted.module
    record["trained_tokens"] = module.trained_tokens  # this process's share, this run (not before a resume)
    record["trained_tokens_total"] = module.tokens_total  # every rank, since step 0
    record["trained_tokens_per_s"] = round(module.trained_tokens / max(module.train_seconds, 1e-9), 1)
    if data.text_costs:  # the answering that wrote the training text, even when this run read it from the cache
        record["training_text_cost"] = data.text_costs
    if data.feature_cache:
        record["feature_cache"] = data.feature_cache
    record["precision"] = {"trainer": str(trainer.precision), **({"probe": fitted.precision_probe}
                                                                  if fitted.precision_probe else {})}
    if fitted.module.optim_cfg.name == "muon":
        record["precision"]["muon_newton_schulz"] = str(fitted.module.newton_schulz_dtype()).removeprefix("torch.")
    if fitted.budget is not None:  # how the budget sized the run: each plan's step, s per step, max_steps
        minute = lambda t: round((t - job.started) / 60, 2)
        unused = max(0.0, (fitted.budget.fit_end - fitted.fit_ended) / 60)
        record["budget"] = {"minutes": job.budget.minutes, "plans": fitted.budget.plans,
                            "fit_ended_minute": minute(fitted.fit_ended), "measured_minute": minute(time.monotonic()),
                            "unused_minutes": round(unused, 2)}
        ceiling = fitted.budget.ceiling  # None where fit never started (a resumed run already at its last step)
        if ceiling is not None and step >= ceiling and unused >= 0.1 * job.budget.minutes:  # the ceiling ended it
            # On a fast CPU the window can hold more data: 3,000 more reference records raised the EAGLE-3 recipe's
            # test τ(γ=3) by 0.07 where 26 of 115 min went unused, 1,200 more steps by 0.011 (docs/results/levers.md)
            log.info("budget: training reached trainer.max_steps=%d with %.1f of %g min unused; more training data "
                     "(data.max_reference_records) or steps (trainer.max_steps) could use it", step, unused,
                     job.budget.minutes)
    if chosen == "best":
        save_head(heads["best"], out / "head", target.identity(),
                  extra={"train": {**train_info, "steps": head_step, "last_step": step}})
    log.info("head/ holds the step-%d head (kept by held-out %s); the last step %d had α %s", head_step,
             "τ at γ = K" if ecfg.best_by == "tau" else "α@1", step, [round(float(a), 3) for a in record["alpha_last"]])
    if trainer.logger:  # the held-out numbers next to the training curves (W&B summary, CSV row)
        metrics = {f"heldout/{key}@{k}": a for key in ("alpha", "alpha_untrained", "alpha_last")
                   for k, a in enumerate(record[key], start=1)}
        trainer.logger.log_metrics({**metrics, "heldout/head_step": head_step}, step=step)
        trainer.logger.save()
    write_json(out / "acceptance.json", record)
    plot_alpha(out / "alpha.png", record)
    log.info("measured α on %d held-out tokens in %.0f s", record["num_tokens"], time.perf_counter() - t0)
    return record


def report(record: dict) -> None:
    """The α table on the console (the CLI's output; library code logs instead)."""
    from rich.console import Console
    from rich.table import Table

    test = record.get("test")
    cover = (test or record).get("draft_vocab_coverage", {}).get(str(record["temperature"]))
    table = Table(title=f"α per draft position: {record['head']} on {record['target']}, temperature "
                        f"{record['temperature']}, {record['num_tokens']} validation tokens"
                        + (f", {test['num_tokens']} test tokens" if test else ""),
                  caption=None if cover is None else f"α ≤ {cover:.1%}, the draft vocabulary's share of the "
                                                     + ("test" if test else "held-out") + " tokens")
    table.add_column("k", justify="right")
    table.add_column("α test" if test else "trained α", justify="right")
    table.add_column("τ test (γ=k)" if test else "τ predicted (γ=k)", justify="right")
    if test:
        table.add_column("α validation", justify="right")
    if "alpha_untrained" in record:
        table.add_column("untrained α", justify="right")
    for k, a in enumerate(record["alpha"], start=1):
        shown = test or record  # the test split is the figure to quote; validation picked the head
        row = [str(k), f"{shown['alpha'][k - 1]:.3f}", f"{shown['tau_predicted'][k]:.2f}"]
        if test:
            row.append(f"{a:.3f}")
        if "alpha_untrained" in record:
            row.append(f"{record['alpha_untrained'][k - 1]:.3f}")
        table.add_row(*row)
    Console().print(table)


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        record = run(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if record:
        report(record)
        log.info("outputs in %s", cfg.out_dir)


if __name__ == "__main__":
    main()
