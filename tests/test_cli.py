import argparse
import subprocess
import sys

from weightstream.cli import COMMANDS, build_parser


def test_every_subcommand_has_help():
    parser = build_parser()
    names = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(names) == len(COMMANDS)  # one subcommand a module (`import` lives in import_gguf.py)
    for name in names:
        out = subprocess.run([sys.executable, "-m", "weightstream.cli", name, "--help"], capture_output=True, text=True)
        assert out.returncode == 0, (name, out.stderr)
        assert name in out.stdout
    assert parser.prog == "weightstream"
