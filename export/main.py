"""Export a native draft head (train/'s DIR/head) to a serving engine's files, validated before it lands.

    python export/main.py head_path=DIR/head format=vllm out=OUTDIR

Reads the head with heads.checkpoint (never a Lightning .ckpt), loads its target (checked against the identity the
head recorded), writes the format's files into OUTDIR.tmp, validates them (export/validate.py: exact keys, shapes,
dtypes, config fields, vocab map, target identity, and a reference forward that reads the files as the engine
does and must reproduce the head's training logits), then renames OUTDIR.tmp to OUTDIR. OUTDIR also gets
draftheads_export.json (what was exported, for which target, with which measured α/τ and settings) and a README
with the engine command.
"""
from __future__ import annotations

import sys
from pathlib import Path

# `python export/main.py` puts export/ itself on sys.path, where vllm.py, eagle.py and medusa.py would shadow the
# packages of those names; drop it and make sure the repo root (the `export` package's parent) is there instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from export import ExportRefused, UserError, format_module  # noqa: E402
from export.common import ExportContext, read_dir, write_dir  # noqa: E402
from export.readme import render_readme  # noqa: E402
from export.validate import (check_config, check_forward, check_identity, check_keys, check_vocab_map,  # noqa: E402
                             head_logits)
from heads.checkpoint import load_head  # noqa: E402
from heads.target import load_target, resolve_path  # noqa: E402

log = logging.getLogger("export")
METADATA = "draftheads_export.json"


SETTING_KEYS = ("gamma", "tree", "tree_paths", "tree_depth", "tree_top_k", "tree_total_tokens", "temperature")


def from_bench(path: Path) -> dict:
    """serve/'s bench.json -> the settings it ran with and what it measured (τ, per-position acceptance, speed)."""
    bench = json.loads(path.read_text())
    settings = bench.get("settings", {})
    out = {k: settings[k] for k in SETTING_KEYS if settings.get(k) is not None}
    out.update({k: bench[k] for k in ("tau_measured", "tokens_per_s", "accept_rate_per_position") if k in bench})
    if (bench.get("auto") or {}).get("predicted"):
        out["predicted"] = bench["auto"]["predicted"]
    return {**out, "source": str(path.resolve())}


def measurements(head_path: Path, head_config: dict, bench: str | None = None) -> tuple[dict, dict]:
    """(recommended, acceptance), each {} when absent.

    recommended: serve/'s measured settings, from ``bench`` (a bench.json path), else a ``recommended`` block in the
    head's config.json, else recommended.json or bench.json in DIR/head or DIR. acceptance: train/'s
    acceptance.json in DIR/head or DIR (train/ writes it next to DIR/head).
    """
    recommended = from_bench(Path(bench)) if bench else dict(head_config.get("recommended") or {})
    acceptance: dict = {}
    for folder in (head_path, head_path.parent):
        if not recommended and (folder / "recommended.json").exists():
            recommended = json.loads((folder / "recommended.json").read_text())
        if not recommended and (folder / "bench.json").exists():
            recommended = from_bench(folder / "bench.json")
        if not acceptance and (folder / "acceptance.json").exists():
            acceptance = json.loads((folder / "acceptance.json").read_text())
    return recommended, acceptance


def resolve_gamma(requested, head, recommended: dict) -> int:
    """γ: asked for, else serve/'s (a chain's gamma, or a tree's depth), else the steps the head was trained for."""
    tree_depth = recommended.get("tree_depth") or max((len(p) for p in recommended.get("tree_paths") or []), default=0)
    gamma = (requested or recommended.get("num_speculative_tokens") or recommended.get("gamma") or tree_depth
             or head.num_steps)
    return min(int(gamma), head.max_draft_steps or int(gamma))


def resolve_target_path(name: str, requested: str | None) -> str | None:
    """The target's HF directory or hub id for engine configs; None for the in-process tiny-random target."""
    if requested:
        return str(Path(requested).resolve()) if Path(requested).exists() else requested
    if name == "tiny-random":
        return None
    return resolve_path(name, None)


def probe_features(target, tokens: int, batch: int = 2, seed: int = 0):
    """Random token batch through the target; every hidden_states index so any aux-id rewrite can be read."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.dims.vocab_size, (batch, tokens), generator=g)
    # fp32 features: the head is checked as trained (fp32), whatever dtype the target was loaded in
    return target.features(ids, layers=range(target.dims.num_layers + 1)).hidden_as(torch.float32)


def validate_export(out: str | Path, fmt: str, ctx: ExportContext, feats, atol: float = 1e-4) -> dict:
    """Every check of export/validate.py on a written directory; returns the report (raises on the first failure)."""
    module, out = format_module(fmt, ctx.family), Path(out)
    config, tensors = read_dir(out, getattr(module, "WEIGHTS", "model.safetensors"))
    check_keys(tensors, module.expected(config, ctx.family), float_dtype=ctx.dtype)
    check_config(config, module.required(ctx))
    if "d2t" in tensors:
        targets = check_vocab_map(tensors["d2t"], ctx.dims.vocab_size, tensors.get("t2d"))
        if not torch.equal(targets, ctx.head.draft_to_target.cpu()):
            raise ValueError("d2t maps to other target ids than the head's vocabulary map")
    if hasattr(module, "check_pickle"):
        module.check_pickle(out)
    check_identity(json.loads((out / METADATA).read_text())["target"], ctx.head_config, ctx.target.identity())
    K = module.num_steps(ctx) if hasattr(module, "num_steps") else ctx.head.num_steps
    reference = module.reference_logits(config, tensors, ctx.family, ctx.target, feats, K)
    trained = head_logits(ctx.head_config, ctx.head.state_dict(), ctx.target, feats, K, ctx.dtype)
    diffs = check_forward(reference, trained, atol)
    return {"tensors": len(tensors), "steps_checked": K, "probe_tokens": list(feats.input_ids.shape),
            "max_abs_logit_diff": diffs}


def metadata(fmt: str, ctx: ExportContext, head_path: Path, written_config: dict) -> dict:
    meta = {
        "format": fmt, "family": ctx.family, "head_path": str(head_path.resolve()),
        "target": {**ctx.target_identity, "path": ctx.target_path},
        "head": {"hparams": ctx.head_config["hparams"], "feature_layers": ctx.head_config["feature_layers"]},
        "num_speculative_tokens": ctx.gamma, "dtype": str(ctx.dtype).removeprefix("torch."),
        "recommended": ctx.recommended, "acceptance": ctx.acceptance,
    }
    for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config"):
        if key in written_config:
            meta[key] = written_config[key]
    return meta


def prepare(head_path, fmt: str, target_path: str | None = None, target_dtype: str = "float32",
            dtype: str | None = None, num_speculative_tokens: int | None = None, bench: str | None = None):
    """Load the head and its target and resolve everything a format needs: (format module, ExportContext).
    Refuses (ExportRefused) before loading the target when the format cannot carry the head's family."""
    head_path = Path(head_path)
    if not head_path.is_dir():
        raise UserError(f"head_path={head_path}: no such directory; pass the head/ directory a training run wrote "
                        "(DIR/head)")
    try:
        head, head_config = load_head(head_path)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"head_path={head_path}: {e}") from e
    module = format_module(fmt, head.family)
    if getattr(head, "eagle31", False) and not getattr(module, "EAGLE31", False):  # it would skip the norms
        raise ExportRefused(f"{head_path} uses EAGLE 3.1 normalisation (head.hparams fc_norm/norm_output), which "
                            f"format={fmt} cannot carry; export it with format=vllm or format=speculators, or "
                            "retrain it with head.hparams.fc_norm=false head.hparams.norm_output=false")
    target_name = head_config.get("target", {}).get("name", "tiny-random")
    try:
        target = load_target(target_name, path=target_path, dtype=target_dtype)
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError; from_pretrained raises both
        raise UserError(f"cannot load target {target_path or target_name}: {str(e).splitlines()[0]}") from e
    head.attach_target(target)
    recommended, acceptance = measurements(head_path, head_config, bench)
    ctx = ExportContext(
        head=head.eval(), head_config=head_config, target_identity=target.identity(),
        target_path=resolve_target_path(target_name, target_path),
        gamma=resolve_gamma(num_speculative_tokens, head, recommended),
        dtype=getattr(torch, dtype or "float32"), recommended=recommended, acceptance=acceptance, target=target,
    )
    return module, ctx


def export(cfg) -> Path:
    """Plain function behind the CLI (tests call it). cfg: head_path, format, out, and conf/export.yaml's keys
    (a dict or DictConfig; missing optional keys take conf/export.yaml's defaults)."""
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    head_path, out = Path(cfg.head_path), Path(cfg.out)
    module, ctx = prepare(head_path, cfg.format, cfg.get("target_path"), cfg.get("target_dtype", "float32"),
                          cfg.get("dtype"), cfg.get("num_speculative_tokens"), cfg.get("bench"))
    head, target = ctx.head, ctx.target
    written = module.write(ctx)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_dir(tmp, written)
    meta = metadata(cfg.format, ctx, head_path, written.config)
    (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
    try:
        feats = probe_features(target, cfg.get("check_tokens", 24))
        meta["validation"] = validate_export(tmp, cfg.format, ctx, feats, cfg.get("atol", 1e-4))
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave files that failed validation where an engine finds them
        raise
    (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
    (tmp / "README.md").write_text(render_readme(cfg.format, module, ctx, meta, str(out.resolve())))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("exported %s head to %s (%s); reference forward max |diff| per step %s", head.family, out, cfg.format,
             meta["validation"]["max_abs_logit_diff"])
    return out


def _hydra_main():
    import hydra

    # An absolute path: Hydra resolves a relative one against the calling module's package when imported.
    @hydra.main(config_path=str(_HERE.parent / "conf"), config_name="export", version_base="1.3")
    def main(cfg):
        try:
            export(cfg)
        except ExportRefused as e:  # a format that cannot carry the head: one line, not a traceback
            sys.exit(f"export refused: {e}")
        except UserError as e:  # as train/ and serve/ answer bad input: one line, exit status 2
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    main()


if __name__ == "__main__":
    _hydra_main()
