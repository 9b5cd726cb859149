"""The CLI run by its own `main` in the test process: for refusals, which happen before any work, and for commands
whose output a test reads (no interpreter, torch or transformers to start for each)."""

from __future__ import annotations

import contextlib
import io


def ran_in_process(*args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `weightstream ARGS` run by the CLI's own `main` in this process. An exception
    other than the CLI's own error type propagates: a traceback fails the test."""
    from weightstream.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, err: str, command: str, *words: str) -> None:
    """The CLI's refusal: exit 2 and one line `weightstream COMMAND: error: ...` holding `words`, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]  # a progress display may leave a blank line
    assert code == 2 and "Traceback" not in err, (code, err)
    errors = [line for line in lines if line.startswith(f"weightstream {command}: error: ")]
    assert len(errors) == 1, err
    for word in words:
        assert word in errors[0], (word, err)


def refused_in_process(*args) -> tuple[int, str]:
    """(exit code, stderr) of `weightstream ARGS` run by `main` in this process: what the command refuses, it
    refuses before any work, so this sees the same message a new process would, in a fraction of the time."""
    code, _, err = ran_in_process(*args)
    return code, err
