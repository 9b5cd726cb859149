"""`weightstream prefetch record|run -- COMMAND`: learn a loader's read order once, replay it ahead of it later."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from weightstream.errors import WeightstreamError

_DESCRIPTION = """\
Model servers start slowly because the loader reads weights through the page cache in an order the kernel
cannot foresee, while the disk idles during parsing and copying. `record` runs a loading command once and
keeps, per process, the ordered ranges of weight files it had to read from disk (a load template, keyed by
the deployment spec). `run` starts the command at once and, when a template for the spec matches the files
on disk, reads those ranges into the page cache just ahead of the loader. Prefetch only adds or drops
page-cache pages: the bytes the command reads never change, and its stdin, stdout, stderr and exit status
pass through untouched. weightstream itself speaks on stderr only."""

_EPILOG = """\
examples:
  weightstream prefetch record --spec model=qwen3-30b tp=1 -- python serve.py --model /models/qwen3
  weightstream prefetch run --spec model=qwen3-30b tp=1 -- python serve.py --model /models/qwen3
  weightstream prefetch run --spec model=qwen3-30b tp=1 --memory-budget 8GiB --json-report load.json -- ./serve

Root uses the kernel's own page-cache events (tracefs, mounted if needed); otherwise residency is sampled
with mincore(2), which is coarser. Templates live in $WEIGHTSTREAM_HOME/templates (default
~/.cache/weightstream). A template that does not match (other spec, changed or missing file, corrupt file) is
ignored with a one-line reason and the command runs exactly as without weightstream."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec",
        nargs="+",
        required=True,
        metavar="KEY=VALUE",
        help="the deployment spec the template belongs to (model, tensor parallelism, loader, ...); "
        "order does not matter",
    )
    p.add_argument(
        "--sampling",
        action="store_true",
        help="use residency sampling even when tracefs works (to compare, or to test the fallback)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")


def register(sub) -> None:
    """Add `prefetch record` and `prefetch run`."""
    p = sub.add_parser(
        "prefetch",
        help="record a loader's read order, replay it as prefetch on later starts",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="verb", metavar="record|run")
    rec = verbs.add_parser(
        "record",
        help="run COMMAND once and save its load template",
        description="Run COMMAND and record, per process, the ordered ranges of weight files it "
        "read from disk. With --model-dir the files' cached pages are dropped first so the "
        "record is complete.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rec.add_argument(
        "--model-dir",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="directory holding the weight files (repeatable); default: the directories of the "
        ".safetensors/.gguf/.bin/.pt files the command opens",
    )
    rec.add_argument(
        "--keep-cache", action="store_true", help="do not drop the model files from the page cache before recording"
    )
    _common(rec)
    rec.set_defaults(func=_record)
    _run_parser(verbs)
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])


def _run_parser(verbs) -> None:
    run = verbs.add_parser(
        "run",
        help="run COMMAND, prefetching ahead of its loader from the template",
        description="Start COMMAND at once and prefetch the template's ranges ahead of its "
        "loader. At exit, print what prefetch did on stderr.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="most bytes prefetched and not yet reached by the loader (e.g. 4GiB); enables "
        "burn-after-reading. Default: unlimited, or 1/4 of the room in a memory-limited cgroup",
    )
    run.add_argument(
        "--reclaim-gap",
        metavar="SIZE",
        default="1GiB",
        help="with a budget, drop pages further than this behind the loader (default 1GiB); "
        "'none' keeps them (for loaders whose tensors stay mapped from the page cache)",
    )
    run.add_argument(
        "--numa-node",
        metavar="N|auto",
        help="put prefetched pages on NUMA node N, or on the node of the GPU the command uses",
    )
    run.add_argument("--threads", type=int, default=4, help="prefetch threads, i.e. reads in flight (default 4)")
    run.add_argument("--json-report", type=Path, metavar="FILE", help="also write the report as JSON to FILE")
    _common(run)
    run.set_defaults(func=_run)


def _argv(args) -> list[str]:
    argv = list(args.command)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise WeightstreamError(
            "no command given; put it after --, e.g. `weightstream prefetch run --spec model=x -- python load.py`"
        )
    return argv


def _say(line: str) -> None:
    print(f"weightstream prefetch: {line}", file=sys.stderr, flush=True)


def _record(args) -> int:
    from weightstream.prefetch.procs import exit_like
    from weightstream.prefetch.record import RecordOptions, record
    from weightstream.prefetch.spec import DeploymentSpec

    for d in args.model_dir:
        if not d.is_dir():
            raise WeightstreamError(f"--model-dir {d} is not a directory; give the directory holding the weights")
    opts = RecordOptions(
        DeploymentSpec.parse(args.spec),
        _argv(args),
        [d.resolve() for d in args.model_dir],
        args.keep_cache,
        args.sampling,
        _say,
    )
    return exit_like(record(opts))


def _run(args) -> int:
    from weightstream.prefetch import numa
    from weightstream.prefetch.procs import exit_like
    from weightstream.prefetch.run import RunOptions, run
    from weightstream.prefetch.settings import Settings
    from weightstream.prefetch.spec import DeploymentSpec
    from weightstream.units import parse_size

    if args.threads < 1:
        raise WeightstreamError(f"--threads {args.threads} must be at least 1")
    budget = parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None
    if budget is not None and budget < (2 << 20):
        raise WeightstreamError(f"--memory-budget {args.memory_budget} is below one 2 MiB prefetch chunk")
    placement = numa.choose(args.numa_node)
    gap = None if args.reclaim_gap.lower() in ("none", "off") else parse_size(args.reclaim_gap, "--reclaim-gap")
    settings = Settings(budget, gap, args.threads, placement)
    opts = RunOptions(DeploymentSpec.parse(args.spec), _argv(args), settings, args.sampling, _say)
    if placement.message:
        _say(placement.message)
    rc, report = run(opts)
    for line in report.lines():
        _say(line)
    if args.json_report:
        report.write(args.json_report)
    return exit_like(rc)
