"""Calibrations saved next to the model (`MODEL_DIR/.weightstream/calibration.json`), keyed by machine and settings,
so the next `tune` reuses them; and `bench`'s linear cost model read back from a `weightstream bench --json` report."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import MISSING, fields
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
        "machine": {"host": platform.node(), "cpu": cpu_model(), **machine},
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


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it: what a calibration or a benchmark names its machine by."""
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


HISTORY = 5  # calibrations kept per machine and setting; tune prices with their term-by-term median
MAX_AGE_S = 14 * 24 * 3600  # older ones are dropped when a new one is saved


def _entries(path: Path) -> list[dict]:
    """The file's entries that can be one (an object with a number for `created`); [] for a damaged file."""
    try:
        entries = json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError, RecursionError):
        return []
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and _number(e.get("created", 0))]


_MOST = 1e6  # seconds (or a ratio): a term past it is damage, and would price every setting at infinity
_REQUIRED = [f.name for f in fields(CostParams) if f.default is MISSING and f.default_factory is MISSING]


def usable_params(params) -> bool:
    """Whether a saved entry's params can price: every term of `CostParams` it needs, each a number from 0 to 10^6
    (None only where CostParams has None for not measured), the readahead's spans pairs of whole bytes, and
    `dense_s` and `page_cached_per_byte` above 0: every step pays `dense_s` (0 would predict a step that reads
    nothing at infinite speed), and the page-cache model divides by the other. A hand-edited or damaged entry fails
    this and is passed over as a damaged file is: `tune` measures again."""
    if not isinstance(params, dict) or any(not _number(params.get(name)) for name in _REQUIRED):
        return False
    for name, f in CostParams.__dataclass_fields__.items():
        value = params.get(name)
        if value is None:
            if name in params and f.default is not None:  # a term every calibration measures
                return False
        elif name == "page_readahead":
            if not isinstance(value, list) or not all(_span(ra) for ra in value):
                return False
        elif not (_number(value) and 0 <= value <= _MOST):
            return False
    return params["dense_s"] > 0 and params.get("page_cached_per_byte", 1.0) > 0


def _span(ra) -> bool:
    """[bytes read ahead of a span, bytes past it]: two whole numbers of 0 or more."""
    return isinstance(ra, list) and len(ra) == 2 and all(type(b) is int and b >= 0 for b in ra)


def _number(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer past a float's range
        return False


def load_saved(path: Path, key: dict) -> dict | None:
    """The calibrations saved for `key` combined, or None (no file, another machine or setting, a damaged file):
    {"params": the term-by-term median of their params, "created": the newest's time, "samples": how many,
    "spread": each term's max/min - 1 over them (None where one was 0), "entries": the saved entries, oldest first}.

    On a VM whose disk and CPU move by 20-40% within minutes, one calibration's minute priced every read of a
    20-minute proof (the cost of a MiB read that does not overlap came out 0.06-0.33 ms in five calibrations back to
    back); the median of the last few calibrations is what the machine usually does."""
    key = json.loads(json.dumps(key))  # tuples become lists, as they were saved
    entries = [e for e in _entries(path) if e.get("key") == key and usable_params(e.get("params"))]
    if not entries:
        return None
    entries.sort(key=lambda e: e.get("created", 0))
    params = median_params([e["params"] for e in entries])
    return {
        "params": params,
        "created": entries[-1].get("created"),
        "samples": len(entries),
        "spread": _spread([e["params"] for e in entries]),
        "entries": entries,
    }


def median_params(samples: list[dict]) -> dict:
    """Each term's median over `samples` (params dicts, oldest first): numbers over those that have one (None where
    none has); lists of numbers (the readahead's spans) element by element where every sample has the same shape,
    else the newest sample's."""
    out = {}
    for name in dict.fromkeys(k for s in samples for k in s):
        values = [s.get(name) for s in samples if s.get(name) is not None]
        if not values:
            out[name] = None
        elif all(isinstance(v, (int, float)) for v in values):
            out[name] = float(statistics.median(values))  # seconds: a JSON 0 or 2**64 is priced as a float
        elif all(_shape(v) == _shape(values[-1]) for v in values) and _shape(values[-1]) is not None:
            out[name] = _elementwise_median(values)
        else:
            out[name] = values[-1]
    return out


def _shape(v):
    if isinstance(v, list):
        inner = [_shape(x) for x in v]
        return None if any(i is None for i in inner) else (len(v), tuple(inner))
    return () if isinstance(v, (int, float)) else None


def _elementwise_median(values: list):
    if isinstance(values[0], list):
        return [_elementwise_median([v[i] for v in values]) for i in range(len(values[0]))]
    return type(values[-1])(statistics.median(values))


def _spread(samples: list[dict]) -> dict:
    spread = {}
    for name in samples[-1]:
        values = [s.get(name) for s in samples if isinstance(s.get(name), (int, float))]
        if values:
            spread[name] = max(values) / min(values) - 1 if min(values) > 0 else None
    return spread


def save(path: Path, key: dict, params: CostParams, measurements: dict, extra: dict, keep: int = HISTORY) -> None:
    """Add an entry for `key`, keeping its newest `keep` (and none older than `MAX_AGE_S`); other keys' entries stay
    as they are. Written atomically: a damaged file is replaced, never half-written."""
    key = json.loads(json.dumps(key))
    now = time.time()
    entries = _entries(path)
    mine = [
        e
        for e in entries
        if e.get("key") == key and now - e.get("created", 0) < MAX_AGE_S and usable_params(e.get("params"))
    ]
    mine.sort(key=lambda e: e.get("created", 0))
    mine = mine[-(keep - 1) :] if keep > 1 else []
    entries = [e for e in entries if e.get("key") != key] + mine
    entries.append(
        {"key": key, "params": params.to_dict(), "measurements": measurements, "extra": extra, "created": now}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"entries": entries}, indent=1))
    os.replace(tmp, path)


def read_cost_model(path: str) -> CostModel:
    """The linear cost model of a `weightstream bench --json` report (or of its `cost_model` object alone), its
    terms checked: each a finite number of seconds, 0 or more, and `fixed_s` above 0 (a step that reads nothing
    takes time; at 0 tune would predict it at infinite tok/s)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise WeightstreamError(f"--cost-model {path}: cannot read it ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep, an integer of 4300+ digits
        raise WeightstreamError(f"--cost-model {path}: not JSON ({exc})") from None
    cm = data.get("cost_model", data) if isinstance(data, dict) else None
    if not isinstance(cm, dict) or "fixed_s" not in cm or "per_mib_s" not in cm:
        raise WeightstreamError(
            f"--cost-model {path}: no cost model in it; pass the output of `weightstream bench --json` with several "
            "--expert-cache sizes (its 'cost_model' has fixed_s and per_mib_s)"
        )
    for name in ("fixed_s", "per_mib_s"):
        value = cm[name]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        shown = value if is_number else repr(value)
        if not is_number:
            wrong = "not a number"
        elif not math.isfinite(value):
            wrong = "not a finite number of seconds"
        elif value < 0:
            wrong = "a negative cost"
        elif value > _MOST:
            wrong = f"more than {_MOST:.0e} s, past any machine's cost (a damaged file)"
        elif name == "fixed_s" and value == 0:
            wrong = "a decode step that reads nothing would take no time (infinite tok/s)"
        else:
            continue
        raise WeightstreamError(
            f"--cost-model {path}: {name} {shown}: {wrong}; pass the 'cost_model' of a `weightstream bench --json` "
            "run with several --expert-cache sizes (fixed_s above 0, per_mib_s 0 or more), or leave out "
            "--cost-model to calibrate this machine"
        )
    r2, points = cm.get("r2"), cm.get("points")
    return CostModel(
        float(cm["fixed_s"]),
        float(cm["per_mib_s"]),
        float(r2) if _number(r2) else float("nan"),  # reported, not used: a missing or odd one is not an error
        points if isinstance(points, int) and not isinstance(points, bool) else 0,
    )
