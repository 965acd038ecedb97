"""Export native draft heads to the files serving engines load. One module per format; see export/main.py."""
from __future__ import annotations

from export import eagle, llamacpp, medusa, mtp, sglang, speculators, vllm
from export.common import ExportRefused, UserError

# format name -> module with FAMILIES, write, required, expected, reference_logits, commands
FORMATS = {"vllm": vllm, "sglang": sglang, "speculators": speculators, "llamacpp": llamacpp, "eagle": eagle,
           "medusa": medusa, "mtp": mtp}


def formats_for(family: str) -> list[str]:
    return [name for name, module in FORMATS.items() if family in module.FAMILIES]


def format_module(fmt: str, family: str):
    """The module for ``fmt``, or a one-line refusal naming the formats this family can go to."""
    if fmt not in FORMATS:
        raise ExportRefused(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if family not in FORMATS[fmt].FAMILIES:
        raise ExportRefused(f"format {fmt!r} cannot carry a {family} head; {family} heads export to: "
                            f"{', '.join(formats_for(family))}")
    return FORMATS[fmt]


__all__ = ["FORMATS", "ExportRefused", "UserError", "format_module", "formats_for"]
