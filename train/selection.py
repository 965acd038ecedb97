"""Keep the best head by held-out acceptance, measured mid-run from the cached held-out features.

Every mid-run check (``DraftModule.heldout``: val/alpha@k, val/tau@γ and the trained tokens so far) is appended to
``OUT/checkpoints/heldout.json``. A check that beats the best so far (``eval.best_by``: τ predicted at γ = K by the
chain walk, or α@1) first saves the head in the native format under ``OUT/checkpoints/best-step<N>.<i>/``; only
then is heldout.json rewritten (atomically) to point at it, and older best directories are removed last. A kill -9
at any moment therefore leaves heldout.json naming a complete head, and ``resume=true`` reads it back, so the best
of an interrupted run stays a candidate. At the end ``train/main.py`` measures the best and the last head on all
held-out data (``final_choice``) and writes the better one to ``OUT/head``.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from heads.base import DraftHead
from heads.checkpoint import load_head, save_head
from train.acceptance import write_json

log = logging.getLogger(__name__)

BEST_BY = ("tau", "alpha")
STATE = "heldout.json"


def score(check: dict, best_by: str) -> float:
    """The figure heads are ranked by: τ predicted at the longest chain (γ = K), or α of draft step 1."""
    if best_by == "alpha":
        return float(check["alpha"][0])
    taus = check["tau_predicted"]
    return float(taus[max(taus, key=int)])


def read_state(dirpath: Path) -> dict | None:
    """heldout.json when it names a head directory that exists (written before the file pointed at it)."""
    try:
        state = json.loads((dirpath / STATE).read_text())
    except (OSError, ValueError):
        return None
    best = state.get("best")
    if best and not (dirpath / best["dir"] / "model.safetensors").exists():
        return None
    return state


class BestHead(Callback):
    """After each mid-run check: record it, and save the head when it is the best so far (rank 0 writes)."""

    def __init__(self, dirpath: Path, best_by: str, target_identity: dict, resume: bool = False):
        self.dirpath, self.best_by, self.identity = Path(dirpath), best_by, target_identity
        self.state = {"best_by": best_by, "best": None, "history": [], "saves": 0}
        old = read_state(self.dirpath) if resume else None
        if old and old.get("best_by") == best_by:
            self.state = old

    def on_validation_end(self, trainer, module) -> None:
        if trainer.sanity_checking or module.heldout is None:
            return
        check, module.heldout = dict(module.heldout), None
        value, best = score(check, self.best_by), self.state["best"]
        is_best = trainer.strategy.broadcast(best is None or value > best["value"], src=0)  # rank 0's files decide
        head = None
        if is_best:
            from train.strategies import consolidated_head  # lazy: imports Lightning's DeepSpeed strategy

            head = consolidated_head(trainer, module.head)  # collective: every rank takes part
        if not trainer.is_global_zero:
            return
        history = [h for h in self.state["history"] if h["step"] != check["step"]]  # a resumed run re-checks a step
        self.state["history"] = sorted([*history, check], key=lambda h: h["step"])
        if is_best:
            self.state["saves"] += 1
            name = f"best-step{check['step']}.{self.state['saves']}"
            self.dirpath.mkdir(parents=True, exist_ok=True)
            save_head(head, self.dirpath / name, self.identity, extra={"train": {"steps": check["step"],
                                                                                 "heldout": check}})
            self.state["best"] = {**check, "value": value, "dir": name}
        write_json(self.dirpath / STATE, self.state)
        if is_best:
            for old in self.dirpath.glob("best-step*"):
                if old.name != self.state["best"]["dir"]:
                    shutil.rmtree(old, ignore_errors=True)
        log.info("held-out check at step %d (%d trained tokens): α %s, τ(γ=%s) %.3f%s", check["step"],
                 check["trained_tokens"], [round(float(a), 3) for a in check["alpha"]], len(check["alpha"]),
                 score(check, "tau"), "  (best so far)" if is_best else "")

    def best(self) -> tuple[DraftHead, dict] | None:
        """The best head so far (loaded from its directory) and its check, or None before any check."""
        best = self.state["best"]
        if best is None:
            return None
        head, _ = load_head(self.dirpath / best["dir"])
        return head, best


def final_choice(measured: dict, temperature: float, best_by: str) -> str:
    """"best" or "last": ``measured`` is measure_sets' result with heads named so, both judged on the same full
    held-out text at the main temperature (a "best" head is only measured when it is not the last step's)."""
    if "best" not in measured:
        return "last"
    best, last = measured["best"][temperature], measured["last"][temperature]
    return "best" if score(best, best_by) > score(last, best_by) else "last"
