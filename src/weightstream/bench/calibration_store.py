"""Calibrations saved next to the model (`MODEL_DIR/.weightstream/calibration.json`), keyed by machine and settings,
so the next `tune` reuses them; and `bench`'s linear cost model read back from a `weightstream bench --json` report."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import transformers

from weightstream import __version__
from weightstream.bench.machine import block_device_of, machine_info
from weightstream.errors import WeightstreamError
from weightstream.sim.cost_model import CostModel
from weightstream.sim.overlap_model import CostParams
from weightstream.store.checkpoint import Checkpoint

MODEL_VERSION = 3  # bump when the cost model's terms change: older calibrations are then measured again
FILE_NAME = "calibration.json"


def calibration_key(ckpt: Checkpoint, io_threads: int, chunk_bytes: int | None) -> dict:
    """What a calibration depends on: this machine, the engine's settings and versions, the checkpoint's files."""
    machine = machine_info(block_device_of(ckpt.model_dir))
    machine.pop("python", None)
    return {
        "machine": {"host": platform.node(), "cpu": _cpu_model(), **machine},
        "settings": {
            "io_threads": io_threads,
            "chunk_bytes": chunk_bytes,
            "compute_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "weightstream": __version__,
            "cost_model": MODEL_VERSION,
        },
        "model": sorted((os.path.basename(p), os.path.getsize(p), int(os.path.getmtime(p))) for p in ckpt.files),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def store_path(model_dir: str) -> Path:
    """MODEL_DIR/.weightstream/calibration.json, or a per-model file in the user's cache where that is read-only."""
    beside = Path(model_dir) / ".weightstream"
    if os.access(model_dir, os.W_OK) and (not beside.exists() or os.access(beside, os.W_OK)):
        return beside / FILE_NAME
    digest = hashlib.sha1(os.path.realpath(model_dir).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weightstream" / "calibration"
    return root / f"{digest}.json"


def load_saved(path: Path, key: dict) -> dict | None:
    """The saved entry for `key`, or None (no file, another machine or setting, or a damaged file)."""
    try:
        entries = json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError):
        return None
    key = json.loads(json.dumps(key))  # tuples become lists, as they were saved
    return next((e for e in entries if e.get("key") == key), None)


def save(path: Path, key: dict, params: CostParams, measurements: dict, extra: dict) -> None:
    """Add or replace the entry for `key` (written atomically)."""
    try:
        entries = json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError):
        entries = []
    key = json.loads(json.dumps(key))
    entries = [e for e in entries if e.get("key") != key]
    entries.append(
        {"key": key, "params": params.to_dict(), "measurements": measurements, "extra": extra, "created": time.time()}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"entries": entries}, indent=1))
    os.replace(tmp, path)


def read_cost_model(path: str) -> CostModel:
    """The linear cost model of a `weightstream bench --json` report (or of its `cost_model` object alone)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise WeightstreamError(f"--cost-model {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise WeightstreamError(f"--cost-model {path}: not JSON ({exc})") from None
    cm = data.get("cost_model", data) if isinstance(data, dict) else None
    if not isinstance(cm, dict) or "fixed_s" not in cm or "per_mib_s" not in cm:
        raise WeightstreamError(
            f"--cost-model {path}: no cost model in it; pass the output of `weightstream bench --json` with several "
            "--expert-cache sizes (its 'cost_model' has fixed_s and per_mib_s)"
        )
    return CostModel(
        float(cm["fixed_s"]), float(cm["per_mib_s"]), float(cm.get("r2", float("nan"))), cm.get("points", 0)
    )
