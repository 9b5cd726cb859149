"""The filemap events in the ring buffer's binary form (per_cpu/cpuN/trace_pipe_raw), without text formatting.

Reading `trace_pipe` makes the kernel print every event as a line of text; for an 8 GiB load that was ~537k
lines and 2.6-3.3 s of CPU in our reader thread, on a machine whose loader needs the same CPUs. The binary
pages cost a copy. Layout (tracefs `events/header_page` and `header_event`): a page is a u64 timestamp, a
commit word whose low 20 bits are the data size (bit 31: events were lost before it), then events. Each event
starts with a u32: type_len (5 bits) and time_delta (27 bits). type_len 1-28: the data is type_len * 4 bytes;
0: a u32 length (itself included) comes first; 29: padding (u32 length); 30: time extend (u32 << 27 added to
the delta); 31: absolute time stamp. Data begins with the common fields (u16 type, u8 flags, u8 preempt,
i32 pid); the rest is read at the offsets the event's `format` file gives.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from weightstream.prefetch.events import PageEvent, join_runs

PAGE_HEADER = 16
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_COMMON = struct.Struct("<HxxI")  # common_type, common_pid (flags and preempt count skipped)


@dataclass(frozen=True, slots=True)
class EventFormat:
    """Where one event's fields sit in its record."""

    kind: str
    ino: int
    dev: int
    index: int
    last_index: int | None = None  # map_pages, get_pages: the range's last page
    order: int | None = None  # add_to_page_cache: folio order


def read_formats(events_dir: Path, kinds: dict[str, str]) -> dict[int, EventFormat]:
    """event id -> field offsets, from `events/filemap/<event>/format`; `kinds` maps event name -> kind.
    Raises ValueError when a field we need is missing or not the size we read."""
    out = {}
    for name, kind in kinds.items():
        text = (events_dir / name / "format").read_text()
        event_id, fields = None, {}
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("ID:"):
                event_id = int(line.split()[1])
            elif line.startswith("field:"):
                parts = dict(p.strip().split(":", 1) for p in line.split(";") if ":" in p)
                fname = parts["field"].split()[-1]
                fields[fname] = (int(parts["offset"]), int(parts["size"]))
        for need, size in (("i_ino", 8), ("s_dev", 4), ("index", 8)):
            if fields.get(need, (0, 0))[1] != size:
                raise ValueError(f"{name}: field {need} missing or not {size} bytes")
        if event_id is None:
            raise ValueError(f"{name}: no event ID")
        out[event_id] = EventFormat(
            kind,
            fields["i_ino"][0],
            fields["s_dev"][0],
            fields["index"][0],
            fields["last_index"][0] if "last_index" in fields else None,
            fields["order"][0] if "order" in fields else None,
        )
    return out


def parse_page(page: bytes, formats: dict[int, EventFormat]) -> tuple[list[tuple], bool]:
    """One ring-buffer page -> ([(timestamp, kind, tid, s_dev, ino, offset, length)], events lost before it)."""
    if len(page) < PAGE_HEADER:
        return [], False
    ts, commit = struct.unpack_from("<QQ", page, 0)
    size = commit & 0xFFFFF
    lost = bool(commit & (1 << 31))
    end = min(PAGE_HEADER + size, len(page))
    pos, out = PAGE_HEADER, []
    unpack_u32, unpack_u64, unpack_common = _U32.unpack_from, _U64.unpack_from, _COMMON.unpack_from
    while pos + 4 <= end:
        header = unpack_u32(page, pos)[0]
        type_len, delta = header & 0x1F, header >> 5
        pos += 4
        if type_len == 29:  # padding: its length follows; none, or beyond the data, ends the page
            if delta == 0 or pos + 4 > end:
                break
            pos += unpack_u32(page, pos)[0]
            continue
        if type_len == 30:  # time extend
            ts += (unpack_u32(page, pos)[0] << 27) + delta
            pos += 4
            continue
        if type_len == 31:  # absolute time stamp
            ts = (unpack_u32(page, pos)[0] << 27) | delta
            pos += 4
            continue
        ts += delta
        if type_len == 0:
            length = unpack_u32(page, pos)[0] - 4
            pos += 4
        else:
            length = type_len * 4
        data = pos
        pos += (length + 3) & ~3
        if pos > end:
            break
        event_type, pid = unpack_common(page, data)
        fmt = formats.get(event_type)
        if fmt is None:
            continue
        ino = unpack_u64(page, data + fmt.ino)[0]
        s_dev = unpack_u32(page, data + fmt.dev)[0]
        index = unpack_u64(page, data + fmt.index)[0]
        if fmt.last_index is not None:
            pages = unpack_u64(page, data + fmt.last_index)[0] + 1 - index
        elif fmt.order is not None:
            pages = 1 << page[data + fmt.order]
        else:
            pages = 1
        out.append((ts, fmt.kind, pid, s_dev, ino, index << 12, pages << 12))
    return out, lost


def to_page_events(records: list[tuple], tgid_of) -> list[PageEvent]:
    """Records in time order -> PageEvents, continuing ones of one task on one file joined (join_runs)."""
    runs = join_runs(((kind, tid, s_dev, ino), offset, length) for _, kind, tid, s_dev, ino, offset, length in records)
    return [
        PageEvent(kind, tid, tgid_of(tid), os.makedev(s_dev >> 20, s_dev & 0xFFFFF), ino, start, end - start)
        for (kind, tid, s_dev, ino), start, end in runs
    ]


class TgidMap:
    """Thread id -> process id: the tracer's saved_tgids (filled by options/record-tgid, so it knows threads
    that have exited), else /proc; a thread nobody knows is taken as its own process."""

    def __init__(self, saved: Path) -> None:
        self.saved, self.known = saved, {}

    def __call__(self, tid: int) -> int:
        tgid = self.known.get(tid)
        if tgid is None:
            self._reload()
            tgid = self.known.get(tid) or _proc_tgid(tid) or tid
            self.known[tid] = tgid
        return tgid

    def _reload(self) -> None:
        try:
            for line in self.saved.read_text().splitlines():
                tid, _, tgid = line.partition(" ")
                if tid.isdigit() and tgid.strip().isdigit() and int(tgid) > 0:
                    self.known.setdefault(int(tid), int(tgid))
        except OSError:
            pass


def _proc_tgid(tid: int) -> int | None:
    try:
        for line in Path(f"/proc/{tid}/status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
