import argparse
import subprocess
import sys

from weightstream.cli import COMMANDS, build_parser

from cli_support import ran_in_process


def test_every_subcommand_has_help():
    parser = build_parser()
    names = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(names) == len(COMMANDS)  # one subcommand a module (`import` lives in import_gguf.py)
    for name in names:  # each command's module loads and its parser prints (in this process: cli_support)
        code, out, err = ran_in_process(name, "--help")
        assert code == 0 and f"weightstream {name}" in out, (name, err)
    # the installed entry point, as a user runs it
    out = subprocess.run([sys.executable, "-m", "weightstream.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and all(name in out.stdout for name in names), out.stderr
    assert parser.prog == "weightstream"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices if actions else {}


def test_every_command_and_action_help_shows_an_example():
    """Issue 52, case 13: a user reading `--help` of any command (and of each `trace`/`bench`/... action) sees at
    least one example command line."""
    missing = []
    for name, sub in _subparsers(build_parser()).items():
        for action, parser in {name: sub, **{f"{name} {a}": p for a, p in _subparsers(sub).items()}}.items():
            text = parser.format_help()
            if "example" not in text:
                missing.append(action)
    assert not missing, f"--help without an example: {missing}"


def test_import_help_names_every_kept_block_type_and_every_architecture():
    """`import --help` says which expert types are kept as they are (the native kernels' types, from the table the
    kernels check themselves against) and which architectures import (the GGUF families): it cannot go stale."""
    from weightstream import native
    from weightstream.store.gguf.families import FAMILIES

    text = " ".join(_subparsers(build_parser())["import"].format_help().split())
    kept = text[text.index("exactly as the file stores them") : text.index("native kernels run")]
    assert all(t in kept for t in native.BLOCK_TYPES), (kept, list(native.BLOCK_TYPES))
    architectures = text[text.index("Architectures:") :]
    assert all(arch in architectures for arch in FAMILIES), (architectures, list(FAMILIES))
