"""Byte sizes: the one grammar every option that takes a size uses, formatting, and the 4 KiB page.

Grammar (case-insensitive, `_` ignored): a number, optionally with a fraction, then an optional unit.
- `KiB`, `MiB`, `GiB`, `TiB`: binary (1024-based);
- `K`, `M`, `G`, `T` (alone, or with `i`): binary too, as systemd, cgroups, Docker and `free` mean them;
- `KB`, `MB`, `GB`, `TB`: decimal (1000-based), as disks are sold;
- no unit or `B`: bytes.
So `4G` = `4GiB` = 4,294,967,296 bytes and `4GB` = 4,000,000,000. A multiple of one token's working set
(`1.5x`) is a cache size, not a byte size: `cache.sizes` handles it on top of this module.
"""

from __future__ import annotations

import re

from weightstream.errors import WeightstreamError

PAGE = 4096  # the page size O_DIRECT aligns to and the page cache counts in
KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_BINARY = {"k": KIB, "m": MIB, "g": GIB, "t": TIB}
_DECIMAL = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)(b?)|(b?))")

SIZE_HELP = "bytes with a unit: 512MiB, 4GiB (binary; 4G means 4GiB too), 4GB (decimal), or a plain byte count"


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes for `text` ('4GiB', '512M', '1.5GB', '1073741824'); WeightstreamError naming `what` otherwise."""
    raw = str(text).strip().lower().replace("_", "")
    match = _SIZE.fullmatch(raw)
    if not match:
        raise WeightstreamError(f"{what} {text!r}: not a size; write {SIZE_HELP}")
    number, prefix, binary_i, byte_b = match.group(1), match.group(2), match.group(3), match.group(4)
    if prefix is None:
        unit = 1
    elif byte_b and not binary_i:  # 'GB': decimal, as disks are sold
        unit = _DECIMAL[prefix]
    else:  # 'GiB', 'Gi', 'G'
        unit = _BINARY[prefix]
    return int(float(number) * unit)


def format_bytes(n: float) -> str:
    """'512 B', '1.5 KiB', '13.8 GiB': binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def page_floor(n: int) -> int:
    """Round down to a page boundary."""
    return n - n % PAGE


def page_ceil(n: int) -> int:
    """Round up to a page boundary."""
    return -(-n // PAGE) * PAGE
