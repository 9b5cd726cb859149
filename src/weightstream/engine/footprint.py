"""The process's memory by part, measured: what `--memory SIZE` sizes the expert cache from.

A memory cgroup charges a process its anonymous pages and the file pages it brings in (the checkpoint's dense
weights are mapped, so they count as they are touched). The engine reads those as resident set size, before the
model (the interpreter and libraries), after the dense weights are loaded, and at the peak of a warm-up forward
(activations, generation temporaries); the expert cache's own pages are read by mincore(2) and taken out, so what
is left is the runtime whatever the cache's size. The rest of SIZE, less the KV cache the context needs and a
margin for what RSS does not show (page tables, kernel buffers, allocator slack), is the expert cache.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from weightstream.cgroup import margin_for
from weightstream.errors import WeightstreamError
from weightstream.io.pagecache import evict
from weightstream.units import MIB, format_bytes

# Under --memory (generate and serve alike, so their tokens stay equal) a prompt is prefilled this many positions
# per forward unless --prefill-chunk says otherwise, and the warm-up runs a prompt that long: what it measured then
# bounds every forward, whatever the prompt's length
MEMORY_PREFILL_CHUNK = 256


def rss() -> tuple[int, int]:
    """(resident set now, its peak since the last `reset_peak`) of this process, in bytes, from /proc."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                found[key] = int(value.split()[0]) * 1024
    return found["VmRSS"], found["VmHWM"]


def reset_peak() -> bool:
    """Starts the peak (VmHWM) over from the current RSS (Linux's clear_refs 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_heap() -> None:
    """Returns the allocator's free memory to the kernel (glibc's malloc_trim): what loading freed stays resident
    otherwise (about 55 MiB after the 4-layer OLMoE shape's dense weights). A no-op where the C library lacks it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20


def bound_heap() -> bool:
    """Allocations from 1 MiB up get their own mapping, given back when freed (glibc's mallopt; the threshold
    then stays fixed instead of rising after each large free). Without it a forward's large temporaries (a prefill's
    dequantized weights, activations) stay in the heap after use, and the resident set after a warm-up varied by
    200 MiB between runs of the same model and prompt; with it, by 1 MiB. False where the C library lacks it."""
    try:
        return ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False


_MADV_RANDOM = 1


def settle_file_pages() -> dict[str, int]:
    """Readies this process's file pages for life at a memory limit: every file mapping (the libraries' code,
    mapped checkpoint pages such as an untied embedding) is marked MADV_RANDOM, so a fault on one reads its own
    page and not the device's readahead window around it, and the mapped files' pages that no mapping holds (what
    readahead brought in around the code at import) are dropped from the page cache. Returns the bytes marked and
    the files dropped.

    Measured in a 1 GiB cgroup (docs/memory.md): without either, the kernel kept about 120 MiB of such cold pages
    charged to the process and evicted hot mapped pages instead; each fault back read up to 8 MiB around the page
    (a virtio disk's read_ahead_kb), which evicted more: 40-100k file refaults and 180 major faults a decoded
    token, as long as a token's reads. With both, none. Either alone did not do it."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        madvise = None
    marked, paths = 0, set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith("/"):
                continue  # anonymous, heap, stack, vdso
            start, end = (int(x, 16) for x in fields[0].split("-"))
            paths.add(fields[5].rstrip("\n"))
            if madvise is not None and madvise(start, end - start, _MADV_RANDOM) == 0:
                marked += end - start
    dropped = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # deleted since it was mapped, or not ours to open
            continue
        try:
            evict(fd)  # clean, unmapped pages only: mapped ones stay
            dropped += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return {"marked_bytes": marked, "files_dropped": dropped}


def machine_memory() -> int:
    """Bytes of RAM on this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tensor_bytes(tensors: Iterable[torch.Tensor], leave_out: torch.Tensor | None = None) -> int:
    """Bytes the tensors' data spans, each byte once (views and tied weights share theirs), less what lies within
    `leave_out`'s span: what the dense weights hold once every one is touched, whatever a cgroup under pressure or the
    page cache has reclaimed of their file pages when the process is measured."""
    skip = (leave_out.data_ptr(), leave_out.data_ptr() + leave_out.nbytes) if leave_out is not None else (0, 0)
    spans = sorted({(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if not t.is_meta and t.nbytes})
    total = end = 0
    for start, stop in spans:
        if skip[0] <= start and stop <= skip[1]:
            continue
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


@dataclass(frozen=True, slots=True)
class Footprint:
    """Bytes by part of a process given `memory` bytes. `libraries`: RSS before the model (interpreter, torch,
    transformers); `dense`: the dense weights resident after load (mapped checkpoint pages and any copy), of which
    `embedding` is the input embedding's rows touched so far (at least what the dense tensors span, `dense_tensors`:
    the pages resident after the warm-up depend on the page cache and on any cgroup the process is in, what the
    tensors span does not); `temporaries`: the warm-up forward's peak above the
    steady state; `kv_cache`: reserved for `context_tokens`; `margin`: what RSS does not show; `expert_cache`: the
    rest, what the cache holds; `context_temporaries`: what a forward late in that context holds beyond the warm-up's
    (`store.facts.context_temporaries`: one layer's KV copied as it grows, repeated for shared KV heads)."""

    memory: int
    libraries: int
    dense: int
    embedding: int
    temporaries: int
    kv_cache: int
    margin: int
    expert_cache: int
    context_tokens: int
    warmup_tokens: int
    context_temporaries: int = 0
    dense_tensors: int = 0

    @property
    def runtime(self) -> int:
        """Everything but the expert cache."""
        return self.libraries + self.dense + self.temporaries + self.context_temporaries + self.kv_cache + self.margin

    def to_dict(self) -> dict:
        return asdict(self)


def check_memory(memory: int, what: str = "--memory") -> None:
    """Refuses a SIZE larger than the machine (it would never constrain, and a cache that large would swap)."""
    total = machine_memory()
    if memory > total:
        raise WeightstreamError(
            f"{what} {format_bytes(memory)}: more than this machine's {format_bytes(total)} of RAM; give at most "
            f"{format_bytes(total)} (or leave {what} out and size the cache with --expert-cache)"
        )


def size_cache(
    memory: int,
    libraries: int,
    steady: int,
    peak: int,
    cache_resident: int,
    embedding: int,
    kv_cache: int,
    context_tokens: int,
    warmup_tokens: int,
    working_set: int,
    context_temporaries: int = 0,
    smaller_kv: str = "",
    dense_tensors: int = 0,
) -> Footprint:
    """The footprint whose expert cache is what `memory` leaves, from the measured RSS figures (`steady` and
    `peak` after the warm-up, `cache_resident` of them the warm-up cache's pages) and the reserved `kv_cache` and
    `context_temporaries`; refuses a `memory` that leaves less than one token's experts (`working_set`), naming the
    size that would do (and `smaller_kv`, another way to a smaller KV cache, where there is one). The dense weights
    count at least `dense_tensors` (what their tensors span, the input embedding's touched rows included), so that a
    measurement whose file pages were reclaimed (a tight cgroup) asks for the size a roomier run measures."""
    dense = max(0, steady - cache_resident - libraries, dense_tensors)
    temporaries = max(0, peak - steady)
    margin = margin_for(memory)
    cache = memory - libraries - dense - temporaries - context_temporaries - kv_cache - margin
    if cache < working_set:
        need = memory - cache + working_set
        need += margin_for(need) - margin  # the margin grows with SIZE
        need = int(need * 1.05)  # and a second measurement differs by some MiB: a size that works the next time
        raise WeightstreamError(
            f"--memory {format_bytes(memory)}: too small for this model here. Measured after loading it and a warm-up "
            f"of {warmup_tokens} tokens: libraries {format_bytes(libraries)}, dense weights "
            f"{format_bytes(dense)}, temporaries {format_bytes(temporaries)}, plus the KV cache of "
            f"{context_tokens} tokens ({format_bytes(kv_cache)}), what a forward that late in it holds more "
            f"({format_bytes(context_temporaries)}) and a margin of {format_bytes(margin)}, which "
            f"leave {format_bytes(max(cache, 0))} where one token's experts need {format_bytes(working_set)}. "
            f"Give --memory {-(-need // MIB)}MiB or more (or a shorter context{smaller_kv})"
        )
    return Footprint(
        memory,
        libraries,
        dense,
        embedding,
        temporaries,
        kv_cache,
        margin,
        cache,
        context_tokens,
        warmup_tokens,
        context_temporaries,
        dense_tensors,
    )
