"""`--miss-copy` replayed: which of a policy's hits compute with an expert's small copy and which read its full blob.

The engine (`cache.expert_cache.ExpertCache`) reads a miss's small copy into a full-size slot and counts the lookup
calls that find it there; the `upgrade_after`-th reads the full blob into the same slot. The policy sees each of those
lookups as the hit it is and never learns what a slot holds, so hits, misses and victims are exact mode's: only the
bytes differ. This module walks the hit mask a replay already decided, one lookup call (`access_layer`, the engine's
`fetch_layer`: a layer group, or a wave of one) at a time, as `ExpertCache.fetch_layer` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from weightstream.errors import WeightstreamError
from weightstream.sim.kernels import njit

if TYPE_CHECKING:
    from weightstream.sim.workload import Calls

SMALL_HIT, UPGRADE = 1, 2  # miss_copy_kinds: computed with the small copy, nothing read / read the full blob
NEVER = 0  # upgrade_after as the kernel takes it: small copies stay until evicted
RATIO_HINT = "0.58 for Q2_K copies of Q4_K experts (quantize --miss-bits 2), 0.76 for Q3_K (--miss-bits 3)"


@njit(cache=True)
def miss_copy_kinds(keys, calls, hit, n_keys, upgrade_after):
    """Per access: UPGRADE where it reads the full blob over the small copy, SMALL_HIT where it computes with the
    small copy and reads nothing, 0 otherwise (a miss, which reads the small copy; a hit on a full blob; a key's
    repeat within its call, which the engine counts once). `calls`: access offsets of the lookup calls;
    `upgrade_after`: NEVER or the hit that upgrades."""
    on_small = np.full(n_keys, -1, np.int64)  # hits a resident small copy has had; -1: absent or full
    seen = np.full(n_keys, -1, np.int64)  # the last call that looked the key up
    out = np.zeros(len(keys), np.uint8)
    for g in range(len(calls) - 1):
        for i in range(calls[g], calls[g + 1]):
            k = keys[i]
            if not hit[i]:  # read as a small copy (an evicted expert that comes back is a miss again)
                on_small[k] = 0
                seen[k] = g
                continue
            if seen[k] == g or on_small[k] < 0:
                seen[k] = g
                continue
            seen[k] = g
            on_small[k] += 1
            if upgrade_after != NEVER and on_small[k] >= upgrade_after:
                out[i] = UPGRADE
                on_small[k] = -1
            else:
                out[i] = SMALL_HIT
    return out


def calls_kinds(calls: Calls, hit: np.ndarray, n_keys: int, upgrade_after: int | None) -> np.ndarray:
    """`miss_copy_kinds` over a cache's lookup calls (`Workload.calls`), from a hit mask in trace order to kinds in
    trace order; `upgrade_after` None for never."""
    kind = miss_copy_kinds(
        calls.keys, calls.offsets, calls.looked_up(hit), n_keys, NEVER if upgrade_after is None else upgrade_after
    )
    return calls.in_trace_order(kind)


@dataclass(frozen=True, slots=True)
class MissCopy:
    """`--miss-copy` as the simulator prices it: a small copy's bytes over its full blob's (`ratio`), and the upgrade
    settings to replay (each the hit on a small copy that reads the full blob, None for never)."""

    ratio: float
    upgrade_after: tuple[int | None, ...] = (1,)

    def __post_init__(self):
        check_ratio(self.ratio)
        if not self.upgrade_after:
            raise WeightstreamError("--upgrade-after: no setting; give e.g. 1,2,4,never")
        for n in self.upgrade_after:
            if n is not None and (not isinstance(n, int) or n < 1):
                raise WeightstreamError(
                    f"--upgrade-after {n}: give numbers of hits (1 or more) or never, comma-separated (e.g. 1,2,never)"
                )


def check_ratio(ratio: float, what: str = "--miss-copy-ratio") -> float:
    """A small copy's bytes over its blob's must be in (0, 1): a copy as large as the blob would save nothing."""
    if not 0.0 < ratio < 1.0:
        raise WeightstreamError(
            f"{what} {ratio:g}: a small copy's bytes over its full blob's must be above 0 and below 1; give e.g. "
            f"{RATIO_HINT}"
        )
    return ratio


def parse_ratio(text: str) -> float:
    """`--miss-copy-ratio` as given: a number in (0, 1)."""
    try:
        ratio = float(text)
    except ValueError:
        raise WeightstreamError(
            f"--miss-copy-ratio {text!r}: not a number; give a small copy's bytes over its full blob's, e.g. "
            f"{RATIO_HINT}"
        ) from None
    return check_ratio(ratio)


def parse_upgrade_after(text: str) -> tuple[int | None, ...]:
    """`--upgrade-after 1,2,never` -> (1, 2, None): each once, in the order given."""
    out: list[int | None] = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        if item == "never":
            out.append(None)
        elif item.isdigit() and int(item) >= 1:
            out.append(int(item))
        else:
            raise WeightstreamError(
                f"--upgrade-after {item}: give numbers of hits (1 or more: the hit on a small copy that reads its "
                "full blob) or never, comma-separated, e.g. 1,2,never"
            )
    if not out:
        raise WeightstreamError(f"--upgrade-after {text!r}: no setting; give e.g. 1,2,4,never")
    return tuple(dict.fromkeys(out))


def setting_name(upgrade_after: int | None) -> str | int:
    """An upgrade setting as the CLI and `--json` write it."""
    return "never" if upgrade_after is None else upgrade_after


def small_bytes(ratio: float, expert_bytes: list[int]) -> np.ndarray:
    """Bytes of one small copy per layer: `ratio` of each layer's expert bytes, rounded to whole bytes."""
    return np.rint(np.asarray(expert_bytes, np.float64) * ratio).astype(np.int64)
