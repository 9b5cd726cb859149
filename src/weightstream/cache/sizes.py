"""Expert cache sizes: a byte size (`weightstream.units` grammar) or a multiple of one token's working set (`1.5x`)."""

from __future__ import annotations

import re

from weightstream.errors import WeightstreamError
from weightstream.units import SIZE_HELP, parse_size

# --miss-copy: the hit on a small copy that reads its full blob. Replayed on DeepSeek-V2-Lite's routing (`simulate
# --miss-copy-ratio`, docs/cache-policies.md), upgrading at the first hit read 0.81x-1.02x of exact mode's bytes at 1x
# to 3.35x caches (a hit then reads a blob where exact mode read nothing), at the eighth 0.59x-0.60x, near never's
# 0.58x, while the experts hit that often still become full precision.
DEFAULT_UPGRADE_AFTER = 8


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


def check_cache_size(text: str | None, what: str = "--expert-cache") -> str | None:
    """`text` as given once it reads as a size or a multiple: a typo is refused before a model loads or a port
    is bound (a multiple is measured against the working set only then)."""
    if text is not None and multiple_of(text) is None:
        parse_cache_size(text, what=what)
    return text
