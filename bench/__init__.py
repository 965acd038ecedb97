"""Benchmarks: ``python -m bench SUBCOMMAND``; each writes OUT/NAME.json beside its markdown table (bench/common.py)."""
