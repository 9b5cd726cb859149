"""Cache sizes for `simulate`: the runtime's size syntax (cache.sizes), comma lists, and START:STOP:STEP ranges."""

from __future__ import annotations

from weightstream.cache.sizes import multiple_of, parse_cache_size
from weightstream.errors import WeightstreamError


def _parse_one(text: str, working_set_bytes: int) -> int:
    """Bytes for one size: 4500MiB, 2GiB, 1.5GB, 123, or a multiple of one token's working set (0.5x)."""
    size = parse_cache_size(text.strip(), working_set_bytes, what="cache size")
    if size <= 0:
        raise WeightstreamError(f"cache size {text!r} must be positive")
    return size


def _size_range(text: str, working_set_bytes: int) -> list[int]:
    parts = text.split(":")
    multiples = [multiple_of(part) for part in parts]
    if all(m is not None for m in multiples):  # count in multiples so 0.5x:8x:0.1x lands exactly on 1x, 2x, ...
        first, last, step = multiples
    else:
        first, last, step = (_parse_one(part, working_set_bytes) for part in parts)
    n = int((last - first) / step + 1e-6) + 1 if step > 0 else 0
    if last < first or not 1 <= n <= 10_000:
        raise WeightstreamError(f"size range {text!r} must go upward in at most 10000 steps (START:STOP:STEP)")
    if all(m is not None for m in multiples):
        return [_parse_one(f"{round(first + i * step, 9)}x", working_set_bytes) for i in range(n)]
    return [int(first + i * step) for i in range(n)]


def parse_sizes(text: str, working_set_bytes: int) -> list[int]:
    """Comma-separated sizes or START:STOP:STEP ranges (both ends included), in the order given."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise WeightstreamError("--sizes is empty; give e.g. 0.5x,1x,2x or 2GiB,4GiB or 0.5x:4x:0.1x")
    sizes = []
    for item in items:
        sizes.extend(
            _size_range(item, working_set_bytes) if item.count(":") == 2 else [_parse_one(item, working_set_bytes)]
        )
    return sizes
