"""Expert cache sizes: a byte size (`weightstream.units` grammar) or a multiple of one token's working set (`1.5x`)."""

from __future__ import annotations

import re

from weightstream.errors import WeightstreamError
from weightstream.units import SIZE_HELP, parse_size

_MULTIPLE = re.compile(r"(\d+(?:\.\d+)?)\s*x")
CACHE_SIZE_HELP = f"{SIZE_HELP}, or a multiple of one token's working set (1.5x)"


def multiple_of(text: str) -> float | None:
    """1.5 for '1.5x'; None when `text` is not a multiple."""
    match = _MULTIPLE.fullmatch(str(text).strip().lower())
    return float(match.group(1)) if match else None


def parse_cache_size(text: str | int, working_set_bytes: int | None = None, what: str = "expert cache") -> int:
    """Bytes for `text`; a multiple like `1.5x` needs the working set it multiplies."""
    multiple = multiple_of(str(text))
    if multiple is None:
        try:
            return parse_size(text, what)
        except WeightstreamError:
            raise WeightstreamError(f"{what} {text!r}: not a size; write {CACHE_SIZE_HELP}") from None
    if working_set_bytes is None:
        raise WeightstreamError(
            f"{what} {text!r}: a multiple of the working set needs a model or trace to "
            "measure it against; give bytes instead, e.g. 2GiB"
        )
    return int(multiple * working_set_bytes)
