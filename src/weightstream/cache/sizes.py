"""Cache sizes as the user writes them: bytes with a unit (`512MiB`, `2GiB`) or a multiple of the working set (`1.5x`)."""

from __future__ import annotations

import re

from weightstream.errors import WeightstreamError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str, working_set_bytes: int | None = None, what: str = "size") -> int:
    """Bytes for `text`; a multiple like `1.5x` needs the working set it multiplies."""
    raw = str(text).strip().lower().replace("_", "")
    multiple = re.fullmatch(r"(\d+(?:\.\d+)?)x", raw)
    if multiple:
        if working_set_bytes is None:
            raise WeightstreamError(f"{what} {text!r}: a multiple of the working set needs a model or trace to "
                                    "measure it against; give bytes instead, e.g. 2GiB")
        return int(float(multiple.group(1)) * working_set_bytes)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", raw)
    if not match or match.group(2) not in _UNITS:
        raise WeightstreamError(f"{what} {text!r}: not a size; write bytes with a unit (512MiB, 2GiB, 1.5GB) "
                                "or a multiple of one token's working set (1.5x)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
