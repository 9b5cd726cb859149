"""The clock tests' fakes (`weightstream.clock.fakes`, which benchmarks/clockfloor.py shares) and their pytest
fixture: every child a test started is ended after it."""

from __future__ import annotations

import pytest

from weightstream.clock.fakes import (
    BURN,
    JETSON_HZ,
    SPAWNED,
    SRC,
    DaemonProcess,
    FakeNvml,
    FakeNvmlError,
    burner,
    make_devfreq_tree,
    read_hz,
    reap_spawned,
    sleeper,
    snapshot_files,
    spawn,
    wait_for,
    write_config,
)

__all__ = [
    "BURN",
    "JETSON_HZ",
    "SPAWNED",
    "SRC",
    "DaemonProcess",
    "FakeNvml",
    "FakeNvmlError",
    "burner",
    "make_devfreq_tree",
    "read_hz",
    "reap_children",
    "sleeper",
    "snapshot_files",
    "spawn",
    "wait_for",
    "write_config",
]


@pytest.fixture(autouse=True)
def reap_children():
    """After each test: SIGTERM what is still running (a daemon restores its floor), then SIGKILL."""
    yield
    reap_spawned()
