"""The ``weightstream`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from weightstream import __version__
from weightstream.errors import WeightstreamError

# Each module under weightstream.commands defines register(subparsers); its parser's `func(args) -> int` runs it.
COMMANDS = (
    "demo",
    "generate",
    "serve",
    "synth",
    "quantize",
    "import_gguf",
    "trace",
    "simulate",
    "tune",
    "bench",
    "prefetch",
    "clockfloor",
)


SIZES_EPILOG = """\
sizes (every option that takes one):
  512MiB, 4GiB, 1.5TiB   binary units (1 GiB = 1024^3 bytes)
  4G, 512M, 4Gi          the same: a bare K/M/G/T is binary, as systemd, cgroups and Docker read it
  4GB, 512MB             decimal units, as disks are sold (1 GB = 1000^3 bytes)
  1073741824             bytes
  1.5x                   expert caches only: a multiple of one token's working set (layers x top-k x expert)

`weightstream COMMAND --help` explains each command."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightstream",
        epilog=SIZES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Application-aware LLM weight I/O: stream MoE experts from SSD through a fixed-budget cache, "
        "choose cache size and policy from real routing traces, prefetch model loads, hold GPU clocks up.",
    )
    parser.add_argument("--version", action="version", version=f"weightstream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"weightstream.commands.{name}").register(sub)
    _dash_digit_is_a_value(parser)
    return parser


# argparse takes a value that starts with '-' for an option unless it is a plain negative number, so
# `--expert-cache -2x` failed with "expected one argument"; no option here is named '-' and a digit, so such a value
# reaches the option's own check, which says what is wrong with it.
_DASH_DIGIT = re.compile(r"^-\.?\d")


def _dash_digit_is_a_value(parser: argparse.ArgumentParser) -> None:
    """Reads '-2x', '-1GiB' (a dash, then a digit) as values in `parser` and every subcommand's parser under it."""
    parser._negative_number_matcher = _DASH_DIGIT
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _dash_digit_is_a_value(child)


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
