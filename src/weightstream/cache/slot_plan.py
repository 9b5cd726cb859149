"""Where one expert's bytes are read to inside its cache slot, and where each parameter is then found.

Checkpoints usually store an expert's tensors next to each other (OLMoE and Qwen: down, gate, up; 12 MiB in
one stretch). Reading each such stretch as one O_DIRECT request, and using the parameters where they land,
saves a request and an aligned page per tensor and the copy that would pack them. Where a parameter cannot be
used in place (its pieces lie apart in the file, as gate and up do when the model fuses them but the file
keeps them in separate places, or it would sit at another address modulo 64 than transformers' in-memory copy,
where fp32 gemv rounds differently), the expert falls back to one request per piece followed by a pack into
the model's contiguous layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from weightstream.io.aligned import aligned_bytes, region_bytes
from weightstream.store.layout import MEMORY_ALIGN, ExpertLayout, Piece

P = TypeVar("P")
PAGE = 4096  # pieces less than a page apart are one span to the page cache (`expert_spans`)


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """Reads into the slot, the copies after they land, and each parameter's place in the slot."""

    requests: tuple[tuple[str, int, int, int], ...]  # (path, offset, nbytes, 4 KiB-aligned destination in the slot)
    packs: tuple[tuple[int, int, int], ...]  # (from, to, nbytes) in the slot, run in order once everything landed
    views: tuple[tuple[str, int, int, tuple[int, ...], object], ...]  # (name, offset in the slot, nbytes, shape, dtype)
    aligned_bytes: int  # what O_DIRECT fetches for this expert: its requests' aligned spans, cut at end of file

    @property
    def slot_bytes(self) -> int:
        return sum(region_bytes(n) for _, _, n, _ in self.requests)


def plan_slot(expert: ExpertLayout, file_sizes: dict[str, int]) -> SlotPlan:
    """Read file-contiguous stretches whole and use parameters in place where possible; else read and pack."""
    return _in_place(expert, file_sizes) or _packed(expert, file_sizes)


def _plan(requests: list, packs: list, views: list, file_sizes: dict[str, int]) -> SlotPlan:
    aligned = sum(aligned_bytes(Piece(path, offset, nbytes), file_sizes[path]) for path, offset, nbytes, _ in requests)
    return SlotPlan(tuple(requests), tuple(packs), tuple(views), aligned)


def file_runs(pieces: Iterable[P], gap: int = 0, where=lambda p: p) -> list[tuple[object, int, int, list[P]]]:
    """Pieces grouped into stretches of one file: [(file, first byte, end byte, its pieces in file order)], in file
    order. `where(piece)` is (file, offset, nbytes): a (file id, offset, nbytes) tuple as it is, or a `Piece`'s
    fields. A piece joins the stretch before it when it starts at most `gap` bytes past that stretch's end (0:
    touching or overlapping); a piece given twice counts once. The one merge of byte ranges: the reader's slot plans
    and the page-cache model's spans (`merge_spans`) both use it."""
    runs: list[list] = []
    for piece in sorted(set(pieces), key=where):
        file, offset, nbytes = where(piece)
        if runs and runs[-1][0] == file and offset <= runs[-1][2] + gap:
            runs[-1][2] = max(runs[-1][2], offset + nbytes)
            runs[-1][3].append(piece)
        else:
            runs.append([file, offset, offset + nbytes, [piece]])
    return [(file, start, end, members) for file, start, end, members in runs]


def merge_spans(pieces: Iterable[tuple[int, int, int]], gap: int = 0) -> list[tuple[int, int, int]]:
    """Pieces (file id, offset, nbytes) merged into contiguous spans (file id, first byte, end byte) (`file_runs`)."""
    return [(file, start, end) for file, start, end, _ in file_runs(pieces, gap)]


def expert_spans(expert: ExpertLayout, file_ids: Mapping[str, int]) -> list[tuple[int, int, int]]:
    """Where one expert lies as the page cache sees it: its pieces merged into spans (file id, first byte, end
    byte), those less than a page apart joined (`merge_spans` at PAGE); `file_ids` numbers the files. The one
    merge of an expert's spans: the page-cache model's (`sim.tune.model_facts`) and calibration's readahead probe."""
    return merge_spans(((file_ids[p.path], p.offset, p.nbytes) for p in expert.pieces), PAGE)


def _piece_where(piece: Piece) -> tuple[str, int, int]:
    return piece.path, piece.offset, piece.nbytes


def _runs(expert: ExpertLayout) -> list[tuple[str, int, int, list[Piece]]]:
    """Maximal stretches of file-adjacent pieces (`file_runs`); stretches in the order their bytes are used."""
    order = {piece: i for i, piece in enumerate(expert.pieces)}
    runs = file_runs(expert.pieces, 0, _piece_where)
    return sorted(runs, key=lambda run: min(order[p] for p in run[3]))  # gate projection first


def _in_place(expert: ExpertLayout, file_sizes: dict[str, int]) -> SlotPlan | None:
    requests, where, dest = [], {}, 0
    for path, start, end, run in _runs(expert):
        nbytes = end - start
        requests.append((path, start, nbytes, dest))
        for piece in run:  # the piece lands `start % 4096` into the run's region, after the pieces before it
            where[piece] = dest + start % 4096 + (piece.offset - start)
        dest += region_bytes(nbytes)
    views = []
    for param in expert.params:
        first = param.pieces[0]
        for a, b in zip(param.pieces, param.pieces[1:]):
            if where[b] != where[a] + a.nbytes:  # not adjacent in the slot: needs a copy
                return None
        if where[first] % MEMORY_ALIGN != param.residue:  # not where eager's copy sits: kernels may round otherwise
            return None
        views.append((param.name, where[first], param.nbytes, param.shape, param.dtype))
    plan = _plan(requests, [], views, file_sizes)
    return plan if plan.slot_bytes <= expert.slot_bytes else None  # the per-piece plan sizes the slots


def _packed(expert: ExpertLayout, file_sizes: dict[str, int]) -> SlotPlan:
    """One request per piece (execution order, gate first), then each moved down to the model's layout."""
    requests, packs, views = [], [], []
    src = dst = 0
    for param in expert.params:
        dst += (param.residue - dst) % MEMORY_ALIGN  # at eager's alignment; a piece's region gives room for it
        views.append((param.name, dst, param.nbytes, param.shape, param.dtype))
        for piece in param.pieces:
            requests.append((piece.path, piece.offset, piece.nbytes, src))
            packs.append((src + piece.offset % 4096, dst, piece.nbytes))
            src += region_bytes(piece.nbytes)
            dst += piece.nbytes
    return _plan(requests, packs, views, file_sizes)
