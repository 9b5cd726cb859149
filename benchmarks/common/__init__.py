"""Shared pieces of the benchmarks in `benchmarks/`: where results go, how an entry point runs one of its named
parts (the subcommands in `parts/`: `llamacpp.py speed`, `kernel_bench.py layer`, `quant_bench.py quality`, ...),
measurement in a child process, alternated rounds, the machine probe, the prefetch benchmark's checkpoint, loaders
and timing. No benchmark of its own.

Entry points are run as `python benchmarks/SCRIPT.py`, which puts `benchmarks/` on the import path: they import
these as `common.NAME` and the parts as `parts.NAME`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """A subcommand of an entry point: `main(argv, prog)` of the module `parts.MODULE`. `named`: the module's own
    parser takes the part's name as its first argument (one module behind several parts: `moe_layer`'s layer,
    crossover and dequant)."""

    module: str
    help: str = ""
    named: bool = False


def run_part(script: str, parts: dict[str, str | Part], argv: list[str] | None = None) -> bool:
    """If the first argument names one of `parts` (name -> module under parts, or a Part), run that module's `main`
    with the remaining arguments (its usage names `script name`) and return True; else return False: the entry
    point runs its own benchmark."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in parts:
        return False
    part = parts[argv[0]]
    part = part if isinstance(part, Part) else Part(part)
    module = importlib.import_module(f"parts.{part.module}")
    if part.named:
        module.main(argv, prog=script)
    else:
        module.main(argv[1:], prog=f"{script} {argv[0]}")
    return True


def entry(script: str, doc: str, parts: dict[str, Part], argv: list[str] | None = None) -> None:
    """An entry point made of parts only: run the part its first argument names; else say which there are
    (`SCRIPT.py --help`), or fail as argparse does."""
    if run_part(script, parts, argv):
        return
    ap = argparse.ArgumentParser(prog=script, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True, metavar="PART")
    for name, part in parts.items():
        sub.add_parser(name, help=part.help, add_help=False)
    ap.parse_args(sys.argv[1:] if argv is None else argv)
