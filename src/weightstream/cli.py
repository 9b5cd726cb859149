"""The ``weightstream`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import sys

from weightstream import __version__
from weightstream.errors import WeightstreamError

# Each module under weightstream.commands defines register(subparsers); its parser's `func(args) -> int` runs it.
COMMANDS = ("demo", "generate", "synth", "trace", "simulate", "tune", "bench", "prefetch", "clockfloor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightstream",
        description="Application-aware LLM weight I/O: stream MoE experts from SSD through a fixed-budget cache, "
        "choose cache size and policy from real routing traces, prefetch model loads, hold GPU clocks up.",
    )
    parser.add_argument("--version", action="version", version=f"weightstream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"weightstream.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except WeightstreamError as exc:
        print(f"weightstream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"weightstream {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
