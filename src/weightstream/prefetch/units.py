"""Byte sizes as users write them ("512MiB", "4G", "1073741824") and as we print them."""

from __future__ import annotations

import re

from weightstream.errors import WeightstreamError

PAGE = 4096
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "size") -> int:
    """Parse "4GiB", "512M", "1.5g" or a plain byte count; binary units (K = 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise WeightstreamError(
            f"{what} {text!r} is not a size; write a number with an optional unit, e.g. 512MiB, 4GiB or 1073741824"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human(n: float) -> str:
    """Format a byte count with a binary unit: 1.50 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def page_floor(n: int) -> int:
    """Round down to a page boundary."""
    return n - n % PAGE


def page_ceil(n: int) -> int:
    """Round up to a page boundary."""
    return -(-n // PAGE) * PAGE
