import subprocess
import sys

from weightstream.cli import COMMANDS, build_parser


def test_every_subcommand_has_help():
    parser = build_parser()
    for name in COMMANDS:
        out = subprocess.run([sys.executable, "-m", "weightstream.cli", name, "--help"], capture_output=True, text=True)
        assert out.returncode == 0, (name, out.stderr)
        assert name in out.stdout
    assert parser.prog == "weightstream"
