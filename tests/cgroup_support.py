"""A memory cgroup made for one test, or the test skipped with why (not root, no memory controller)."""

from __future__ import annotations

import os

import pytest

from weightstream.cgroup import CgroupMemory, MemoryCgroup
from weightstream.errors import WeightstreamError


def cgroup_or_skip(limit: int, name: str = "ws-test") -> MemoryCgroup:
    if os.geteuid() != 0 or CgroupMemory.of() is None:
        pytest.skip("needs root and a memory cgroup controller (CI is root)")
    try:
        return MemoryCgroup.create(limit, name=name)
    except WeightstreamError as exc:
        pytest.skip(str(exc))
