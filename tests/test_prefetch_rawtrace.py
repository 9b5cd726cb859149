"""The binary trace reader against the kernel's own text for the same events, and its page parser on made-up
pages (every record kind the ring buffer writes)."""

from __future__ import annotations

import os
import struct
import threading

import pytest

from weightstream.prefetch import rawtrace
from weightstream.prefetch.events import ACCESS, MISS, READ

from prefetch_support import drop, loader, make_checkpoint, tracefs_ok

pytestmark = pytest.mark.usefixtures("no_proactive_reclaim")  # counts cached pages or bytes read

MIB = 1 << 20
FORMATS = {
    600: rawtrace.EventFormat(MISS, ino=16, dev=32, index=24, order=36),
    598: rawtrace.EventFormat(ACCESS, ino=8, dev=16, index=24, last_index=32),
}


def _record(event_id: int, pid: int, ino: int, s_dev: int, index: int, extra: int) -> bytes:
    body = bytearray(40)
    struct.pack_into("<HBBi", body, 0, event_id, 0, 0, pid)
    if event_id == 600:
        struct.pack_into("<QQQIB", body, 8, 0, ino, index, s_dev, extra)  # pfn, ino, index, dev, order
    else:
        struct.pack_into("<QI4xQQ", body, 8, ino, s_dev, index, extra)  # ino, dev, index, last_index
    return struct.pack("<I", len(body) // 4 | (5 << 5)) + bytes(body)  # type_len 10, delta 5


def test_parse_page_reads_every_kind_of_record():
    dev = (8 << 20) | 1
    data = _record(600, 42, 7, dev, 3, 2)  # an order-2 folio at page 3: 16 KiB
    data += struct.pack("<II", 30, 1)  # time extend: +1 << 27
    data += _record(598, 42, 7, dev, 10, 13)  # pages 10..13 mapped
    data += struct.pack("<II", 29 | (1 << 5), 12) + b"\0" * 8  # a discarded event: length counts itself
    big = _record(598, 43, 7, dev, 20, 20)[4:]
    data += struct.pack("<II", 0 | (3 << 5), len(big) + 4) + big  # type_len 0: explicit length
    page = struct.pack("<QQ", 1000, len(data) | (1 << 31)) + data
    page += b"\xff" * (4096 - len(page))  # garbage past the commit size is never read
    records, lost = rawtrace.parse_page(page, FORMATS)
    assert lost
    assert [r[1:] for r in records] == [
        (MISS, 42, dev, 7, 3 * 4096, 16384),
        (ACCESS, 42, dev, 7, 10 * 4096, 4 * 4096),
        (ACCESS, 43, dev, 7, 20 * 4096, 4096),
    ]
    assert [r[0] for r in records] == [1005, 1005 + (1 << 27) + 5, 1005 + (1 << 27) + 5 + 3]  # deltas add up
    events = rawtrace.to_page_events(records, lambda tid: 40)
    assert events[0].dev == os.makedev(8, 1) and events[0].tgid == 40


def test_unknown_events_are_skipped_and_a_short_page_is_empty():
    page = struct.pack("<QQ", 0, 44) + _record(999, 1, 1, 1, 1, 1)
    assert rawtrace.parse_page(page, FORMATS) == ([], False)
    assert rawtrace.parse_page(b"\0" * 8, FORMATS) == ([], False)


def _covered(events, kinds) -> dict:
    """(kind, tgid, ino) -> set of pages: joins may differ between readers, the pages may not."""
    out: dict = {}
    for e in events:
        if e.kind in kinds:
            out.setdefault((e.kind, e.tgid, e.ino), set()).update(
                range(e.offset // 4096, (e.offset + e.length) // 4096)
            )
    return out


@pytest.mark.skipif(not tracefs_ok(), reason="needs root and tracefs with the filemap events (CI runs as root)")
@pytest.mark.parametrize("mode", ["read", "mmap"])
def test_binary_reader_sees_what_the_text_pipe_sees(tmp_path, mode):
    from weightstream.prefetch.procs import GatedCommand
    from weightstream.prefetch.tracefs import TraceSession, find_tracefs, inode_filter

    root = make_checkpoint(tmp_path / "m", {"a.safetensors": 6 * MIB, "b.safetensors": 3 * MIB + 4096})
    paths = [str(p) for p in sorted(root.iterdir())]
    drop(paths)
    ids = [(os.stat(p).st_dev, os.stat(p).st_ino) for p in paths]
    tracefs_root = find_tracefs()[0]
    got = {"binary": [], "text": []}
    sessions = {}
    cmd = GatedCommand(loader(mode, paths))  # held before exec until both readers follow it
    try:
        for fmt in ("binary", "text"):
            s = TraceSession(tracefs_root)
            s.format = fmt
            s.follow_pid(cmd.pid)
            s.set_filter(inode_filter(ids))
            lock = threading.Lock()
            s.start(lambda evs, f=fmt, lock=lock: (lock.acquire(), got[f].extend(evs), lock.release()))
            sessions[fmt] = s
        assert sessions["binary"].format == "binary"
        cmd.release()
        assert cmd.wait() == 0
    finally:
        cmd.kill()
        for s in sessions.values():
            s.stop()
    kinds = (MISS, ACCESS) if mode == "mmap" else (MISS,)
    binary, text = _covered(got["binary"], kinds), _covered(got["text"], kinds)
    assert binary == text and binary  # the same pages, per kind, process and file
    missed = sum(len(v) for (k, _, _), v in binary.items() if k == MISS) * 4096
    assert missed >= 9 * MIB  # everything was cold: every page of both files was a miss
    if mode == "read":
        assert any(e.kind == READ for e in got["binary"]) and sessions["binary"].pages_lost == 0
