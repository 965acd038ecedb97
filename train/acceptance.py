"""Acceptance α of draft heads on held-out data, ``acceptance.json``, and the α-per-position plot.

For each held-out position t and draft step k, α_k = Σ_x min(p_k(x), q_k(x)) with p_k the target's and q_k the
head's distribution after the same temperature/top-k/top-p processing (heads.losses.alpha_sums); earlier draft
steps see the held-out tokens, i.e. the path along which every earlier draft was accepted. Sums and token counts
are aggregated exactly over all held-out tokens, then divided once. Several heads (trained, untrained) share one
target forward per batch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from heads.base import DraftHead
from heads.losses import alpha_sums, tau_predicted
from heads.target import Target


@torch.no_grad()
def measure(heads: dict[str, DraftHead], target: Target, loader, temperatures, top_k: int = 0,
            top_p: float = 1.0) -> dict[str, dict[float, dict]]:
    """-> {head name: {temperature: {"alpha": [α_k], "num_tokens": [n_k]}}}."""
    device = next(target.model.parameters()).device
    layers = sorted({k for h in heads.values() for k in h.feature_layers})
    sums = {(n, t): None for n in heads for t in temperatures}
    for head in heads.values():
        head.eval().to(device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        attn = None if bool(batch["attention_mask"].all()) else batch["attention_mask"]
        feats = target.features(batch["input_ids"], batch["loss_mask"], attn, layers=layers)
        for name, head in heads.items():
            out = head(feats.hidden_as(next(head.parameters()).dtype))  # a bf16 target's features, an fp32 head
            for t in temperatures:
                s, c = alpha_sums(head, out, feats, t, top_k, top_p)
                step = torch.tensor([s, c], dtype=torch.float64)  # [2, K]
                sums[name, t] = step if sums[name, t] is None else sums[name, t] + step
    result: dict[str, dict[float, dict]] = {n: {} for n in heads}
    for (name, t), total in sums.items():
        s, c = total.tolist()
        result[name][t] = {"alpha": [a / n if n else 0.0 for a, n in zip(s, c)], "num_tokens": [int(n) for n in c]}
    return result


def acceptance_record(head_name: str, target_name: str, data: str, temperature: float, measured: dict,
                      untrained: dict | None = None, top_k: int = 0, top_p: float = 1.0) -> dict:
    """The acceptance.json schema: measured = {temperature: {"alpha", "num_tokens"}} for one head."""
    main = measured[temperature]
    record = {
        "head": head_name, "target": target_name, "data": data, "temperature": temperature, "top_k": top_k,
        "top_p": top_p, "alpha": main["alpha"], "tau_predicted": tau_predicted(main["alpha"]),
        "num_tokens": main["num_tokens"][0], "num_tokens_per_step": main["num_tokens"],
        "alpha_by_temperature": {str(t): m["alpha"] for t, m in measured.items()},
    }
    if untrained is not None:
        record["alpha_untrained"] = untrained[temperature]["alpha"]
        record["alpha_untrained_by_temperature"] = {str(t): m["alpha"] for t, m in untrained.items()}
    return record


def write_json(path: Path, obj: dict) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)  # atomic: readers never see half a file


def plot_alpha(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    ks = list(range(1, len(record["alpha"]) + 1))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(ks, record["alpha"], "o-", label="trained")
    if "alpha_untrained" in record:
        ax.plot(ks, record["alpha_untrained"], "s--", label="untrained")
    ax.set_xlabel("draft position k")
    ax.set_ylabel(f"α_k (temperature {record['temperature']})")
    ax.set_ylim(0, 1)
    ax.set_xticks(ks)
    ax.set_title(f"{record['head']} on {record['target']}: {record['num_tokens']} held-out tokens", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
