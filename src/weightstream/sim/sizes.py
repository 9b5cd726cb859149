"""Cache sizes as users write them: bytes with a unit (4500MiB, 2GiB, 1.5GB) or multiples of one token's
working set (0.5x, 1.8x)."""

from __future__ import annotations

import re

from weightstream.errors import WeightstreamError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, working_set_bytes: int) -> int:
    """Bytes for one size spec; `Nx` means N times `working_set_bytes`."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or (unit not in UNITS and unit != "x"):
        raise WeightstreamError(f"cache size {text!r} is not a size; write bytes with an optional unit "
                                f"(4500MiB, 2GiB, 1.5GB) or a multiple of one token's working set (0.5x, 1.8x)")
    value = float(match.group(1))
    size = int(value * working_set_bytes) if unit == "x" else int(value * UNITS[unit])
    if size <= 0:
        raise WeightstreamError(f"cache size {text!r} must be positive")
    return size


def _size_range(text: str, working_set_bytes: int) -> list[int]:
    parts = text.split(":")
    multiples = [_multiple(part) for part in parts]
    if all(m is not None for m in multiples):  # count in multiples so 0.5x:8x:0.1x lands exactly on 1x, 2x, ...
        (first, last, step), scale = multiples, None
    else:
        (first, last, step), scale = (parse_size(part, working_set_bytes) for part in parts), 1
    n = int((last - first) / step + 1e-6) + 1 if step > 0 else 0
    if last < first or not 1 <= n <= 10_000:
        raise WeightstreamError(f"size range {text!r} must go upward in at most 10000 steps (START:STOP:STEP)")
    if scale:
        return [int(first + i * step) for i in range(n)]
    return [parse_size(f"{round(first + i * step, 9)}x", working_set_bytes) for i in range(n)]


def _multiple(part: str) -> float | None:
    match = _SIZE.match(part)
    return float(match.group(1)) if match and match.group(2).lower() == "x" else None


def parse_sizes(text: str, working_set_bytes: int) -> list[int]:
    """Comma-separated sizes or START:STOP:STEP ranges (both ends included), in the order given."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise WeightstreamError("--sizes is empty; give e.g. 0.5x,1x,2x or 2GiB,4GiB or 0.5x:4x:0.1x")
    sizes = []
    for item in items:
        if item.count(":") == 2:
            sizes.extend(_size_range(item, working_set_bytes))
        else:
            sizes.append(parse_size(item, working_set_bytes))
    return sizes
