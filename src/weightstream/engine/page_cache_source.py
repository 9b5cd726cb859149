"""The page-cache baseline: expert bytes reached through mmap of the checkpoint, as llama.cpp and safetensors do.

No expert cache of our own and no reads of our own: the kernel faults pages in on first touch and keeps or
drops them as memory allows. Same engine, same exact arithmetic, so tokens equal the direct path's.
"""

from __future__ import annotations

import mmap
import queue

import torch

from weightstream.cache.expert_cache import CacheStats, LayerFetch
from weightstream.io.pagecache import process_read_bytes
from weightstream.store.layout import MEMORY_ALIGN, ExpertParam, ModelLayout


class PageCacheSource:
    """Serves expert parameters as views of mmapped checkpoint files (a copy only where gate and up are apart)."""

    io_threads = 0
    o_direct = False

    def __init__(self, layout: ModelLayout):
        self.layout = layout
        self._read_base = process_read_bytes()
        self.stats = CacheStats()
        self.n_slots = len(layout.experts)
        self.budget_bytes = self.memory_bytes = 0
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        for path in sorted({p.path for e in layout.experts.values() for p in e.pieces}):
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never written back
            self._maps[path] = (mm, torch.frombuffer(mm, dtype=torch.uint8))

    @property
    def reads_counted(self) -> bool:
        return self._read_base is not None

    @property
    def bytes_read(self) -> int:
        """Bytes the kernel read from storage for this process since the source opened (its faults and their
        readahead: experts, and dense weights faulted in again after reclaim); 0 where the kernel does not count."""
        now = process_read_bytes() if self._read_base is not None else None
        return now - self._read_base if now is not None else 0

    def fetch_layer(self, layer: int, experts: list[int]) -> LayerFetch:
        resident = list(dict.fromkeys(experts))
        self.stats.hits += len(experts)
        return LayerFetch(layer, resident, [], queue.SimpleQueue())

    def params(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return {p.name: self._tensor(p) for p in self.layout.experts[(layer, expert)].params}

    def holds_small_copy(self, layer: int, expert: int) -> bool:
        return False  # --miss-copy needs the expert cache's slots

    def wait(self, fetch: LayerFetch) -> int:
        raise AssertionError("the mmap source has no pending reads")

    def close(self) -> None:
        self._maps.clear()  # tensors still in use keep their mapping alive

    def _tensor(self, param: ExpertParam) -> torch.Tensor:
        first = param.pieces[0]
        contiguous = all(
            p.path == first.path and p.offset == first.offset + sum(q.nbytes for q in param.pieces[:i])
            for i, p in enumerate(param.pieces)
        )
        if contiguous:
            raw = self._maps[first.path][1][first.offset : first.offset + param.nbytes]
        else:  # e.g. Mixtral's w1 and w3 are apart on disk: the model's gate_up layout needs one copy
            raw = torch.cat([self._maps[p.path][1][p.offset : p.offset + p.nbytes] for p in param.pieces])
        if raw.data_ptr() % MEMORY_ALIGN != param.residue:  # where eager's copy sits, or kernels may round otherwise
            raw = _at_residue(raw, param.residue)
        return raw.view(param.dtype).view(param.shape)


def _at_residue(raw: torch.Tensor, residue: int) -> torch.Tensor:
    """A copy of the bytes `raw` whose address is `residue` modulo MEMORY_ALIGN."""
    buf = torch.empty(raw.numel() + MEMORY_ALIGN, dtype=torch.uint8)
    start = (residue - buf.data_ptr()) % MEMORY_ALIGN
    out = buf[start : start + raw.numel()]
    out.copy_(raw)
    return out
