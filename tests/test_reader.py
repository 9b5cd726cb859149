"""The O_DIRECT reader returns exactly the bytes a plain pread returns, at awkward sizes and offsets."""

import os
import threading

import pytest

from weightstream.errors import WeightstreamError
from weightstream.io.aligned import AlignedArena, region_bytes, round_up
from weightstream.io.reader import DirectReader, ReadRequest

PRIME_NEAR_4_4MB = 4_400_009
CASES = [
    (0, 1),
    (0, 4095),
    (0, 4096),
    (0, 4097),
    (1, 4095),
    (4095, 2),
    (4097, 4096),
    (123, PRIME_NEAR_4_4MB),
    (8192, 3 * 128 * 1024 + 17),
    (4_406_400, 4_406_400),
]  # gpt-oss-20b's expert tensor size


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "blob.bin"
    path.write_bytes(os.urandom(16 * 1024 * 1024 + 333))
    return str(path)


def read_all(path, requests, threads, o_direct=True, chunk=128 * 1024):
    arena = AlignedArena(round_up(sum(region_bytes(n) for _, n in requests)))
    reader = DirectReader(arena, threads=threads, chunk_bytes=chunk, o_direct=o_direct)
    done, errors, dest, placed = threading.Event(), [], 0, []
    batch = []
    for offset, n in requests:
        batch.append(ReadRequest(path, offset, n, dest))
        placed.append(dest + offset % 4096)
        dest += region_bytes(n)
    reader.submit(batch, lambda err: (errors.append(err), done.set()))
    assert done.wait(30)
    reader.close()
    assert errors == [None]
    return [bytes(arena.view[p : p + n]) for p, (_, n) in zip(placed, requests)], reader


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("o_direct", [True, False])
def test_bytes_equal_pread(data_file, threads, o_direct):
    got, reader = read_all(data_file, CASES, threads, o_direct)
    fd = os.open(data_file, os.O_RDONLY)
    try:
        for (offset, n), data in zip(CASES, got):
            assert data == os.pread(fd, n, offset), (offset, n)
    finally:
        os.close(fd)
    assert reader.buffered_fallback is False


def test_neighbouring_regions_untouched(data_file):
    """A read's last aligned page must not spill into the next tensor's slot region (the 'GGGG' bug)."""
    requests = [(4_406_400 * i + 1, 4_406_400) for i in range(3)]
    got, _ = read_all(data_file, requests, threads=4)
    fd = os.open(data_file, os.O_RDONLY)
    assert [g == os.pread(fd, n, o) for g, (o, n) in zip(got, requests)] == [True, True, True]
    os.close(fd)


def test_tail_of_file(data_file):
    size = os.path.getsize(data_file)
    got, reader = read_all(data_file, [(size - 5000, 5000)], threads=2)
    with open(data_file, "rb") as f:
        f.seek(size - 5000)
        assert got[0] == f.read()
    # aligned start, cut at end of file; plus the probe of the file's first page when O_DIRECT opened it
    assert reader.bytes_read == size - (size - 5000) // 4096 * 4096 + (0 if reader.buffered_fallback else 4096)


def test_errors_reach_the_caller(tmp_path):
    arena = AlignedArena(8192)
    reader = DirectReader(arena, threads=1)
    errors, done = [], threading.Event()
    reader.submit([ReadRequest(str(tmp_path / "missing"), 0, 10, 0)], lambda e: (errors.append(e), done.set()))
    assert done.wait(10)
    reader.close()
    assert isinstance(errors[0], WeightstreamError) and "missing" in str(errors[0])


def test_bad_settings():
    arena = AlignedArena(4096)
    with pytest.raises(WeightstreamError, match="at least 1"):
        DirectReader(arena, threads=0)
    with pytest.raises(WeightstreamError, match="multiple of 4096"):
        DirectReader(arena, threads=1, chunk_bytes=1000)


@pytest.mark.parametrize("o_direct", [True, False])
@pytest.mark.parametrize("cut", [0, 4096 * 3, 4096 * 3 + 100])  # cut at, past the start of, inside a request
def test_a_file_truncated_after_opening_is_an_error_not_stale_bytes(tmp_path, o_direct, cut):
    """A read at or past the file's new end used to raise nothing and leave the slot's old bytes in place."""
    path = tmp_path / "shrinks.bin"
    path.write_bytes(os.urandom(64 * 1024))
    offset, n = 4096 * 3 + 10, 20_000
    arena = AlignedArena(round_up(region_bytes(n)))
    arena.view[:] = b"\xab" * arena.nbytes  # what a previous expert left in the slot
    reader = DirectReader(arena, threads=2, chunk_bytes=8192, o_direct=o_direct)
    reader.open_files([str(path)])  # opened (and indexed) while whole
    os.truncate(path, cut)
    errors, done = [], threading.Event()
    reader.submit([ReadRequest(str(path), offset, n, 0)], lambda e: (errors.append(e), done.set()))
    assert done.wait(10)
    reader.close()
    assert isinstance(errors[0], WeightstreamError), errors
    message = str(errors[0])
    assert str(path) in message and "short read at byte" in message and "needs" in message


@pytest.fixture
def no_o_direct_dir(tmp_path, monkeypatch):
    """A directory whose files refuse O_DIRECT: a ramfs mount (root), else an EINVAL injected at open."""
    import errno
    import subprocess

    where = tmp_path / "ramfs"
    where.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True).returncode == 0
    )
    if not mounted:
        real_open = os.open

        def refusing_open(path, flags, *args, **kwargs):
            if flags & os.O_DIRECT and str(path).startswith(str(where)):
                raise OSError(errno.EINVAL, "Invalid argument", str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
    yield where, "ramfs" if mounted else "injected EINVAL"
    if mounted:
        subprocess.run(["umount", str(where)], check=True)


def test_buffered_fallback_where_o_direct_is_refused(no_o_direct_dir):
    where, how = no_o_direct_dir
    data = os.urandom(300_001)
    path = where / "blob.bin"
    path.write_bytes(data)
    warnings = []
    arena = AlignedArena(round_up(region_bytes(len(data))))
    reader = DirectReader(arena, threads=2, chunk_bytes=64 * 1024, warn=warnings.append)
    done, errors = threading.Event(), []
    reader.submit([ReadRequest(str(path), 5, len(data) - 5, 0)], lambda e: (errors.append(e), done.set()))
    assert done.wait(10)
    reader.submit([ReadRequest(str(path), 0, 10, 0)], lambda e: None)  # a second read: no second warning
    reader.close()
    assert errors == [None], how
    assert bytes(arena.view[5 : len(data)]) == data[5:]
    assert reader.buffered_fallback is True
    assert len(warnings) == 1 and "O_DIRECT refused for" in warnings[0] and str(path) in warnings[0]
    assert "falling back to buffered reads" in warnings[0]
