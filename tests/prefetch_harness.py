"""Runs weightstream.prefetch.run.run() in this process, then prints what it left behind, as JSON.

usage: python prefetch_harness.py SPEC_KEY=VALUE -- COMMAND...
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from weightstream.prefetch.procs import process_tree
from weightstream.prefetch.run import RunOptions, run
from weightstream.prefetch.settings import Settings
from weightstream.prefetch.spec import DeploymentSpec


def main() -> None:
    split = sys.argv.index("--")
    spec = DeploymentSpec.parse(sys.argv[1:split])
    opts = RunOptions(
        spec,
        sys.argv[split + 1 :],
        Settings(budget=4 << 20, reclaim_gap=2 << 20, threads=3),
        say=lambda line: print(line, file=sys.stderr),
    )
    rc, report = run(opts)
    deadline = time.monotonic() + 2.0  # a joined thread's OS task can take a moment to disappear
    while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    instances = [p.name for p in Path("/sys/kernel/tracing/instances").glob(f"weightstream-{os.getpid()}-*")]
    left = {
        "rc": rc,
        "template_used": report.template_used,
        "threads": [t.name for t in threading.enumerate()],
        "tasks": len(os.listdir("/proc/self/task")),
        "task_names": [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")],
        "children": process_tree(os.getpid())[1:],
        "instances": instances,
        "prefetched": report.bytes_prefetched,
    }
    print(json.dumps(left))


if __name__ == "__main__":
    main()
