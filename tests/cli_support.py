"""The CLI run by its own `main` in the test process: for refusals, which happen before any work."""

from __future__ import annotations


def refused_in_process(*args) -> tuple[int, str]:
    """(exit code, stderr) of `weightstream ARGS` run by the CLI's own `main` in this process: what the command
    refuses, it refuses before any work, so this sees the same message a new process would, in a fraction of the
    time (no interpreter, torch or transformers to start). An uncaught exception propagates: a traceback fails."""
    import contextlib
    import io

    from weightstream.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
    return code, err.getvalue()
