"""Shared helpers for the prefetch tests: a real checkpoint on disk, and running the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

LOADER = str(Path(__file__).with_name("prefetch_loader.py"))
SIZES = {"model-00001.safetensors": 24 << 20, "model-00002.safetensors": (5 << 20) + 4097, "extra.bin": 4095}


def tracefs_ok() -> bool:
    """Whether this machine gives us the kernel's page-cache events."""
    from weightstream.prefetch.tracefs import find_tracefs

    return find_tracefs()[0] is not None


def make_checkpoint(root: Path, sizes: dict[str, int] = SIZES, seed: int = 0) -> Path:
    """Files of random bytes (the loader hashes bytes; they need not be valid safetensors for read/mmap)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, size in sizes.items():
        (root / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return root


def files(root: Path) -> list[str]:
    """The checkpoint's weight files in name order."""
    return sorted(str(p) for p in root.iterdir() if p.suffix in (".safetensors", ".bin"))


def drop(paths: list[str]) -> None:
    """Make the files cold."""
    from weightstream.io.pagecache import evict_file

    for p in paths:
        evict_file(p)


def env_with_home(home: Path) -> dict[str, str]:
    """The environment for a CLI run with its own template store."""
    env = dict(os.environ, WEIGHTSTREAM_HOME=str(home))
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def cli(home: Path, *args: str, input: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `weightstream ARGS` for real and capture its output as bytes."""
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args],
        env=env_with_home(home),
        input=input,
        capture_output=True,
        timeout=timeout,
    )


def loader(mode: str, paths: list[str], *extra: str) -> list[str]:
    """argv of the test loader."""
    return [sys.executable, LOADER, mode, *paths, *extra]
