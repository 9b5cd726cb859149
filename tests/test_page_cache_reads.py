"""The page-cache path's bytes read: the kernel's count of this process's reads, cold files read, cached not."""

import pytest

from weightstream.engine.loader import read_layout
from weightstream.engine.page_cache_source import PageCacheSource
from weightstream.io.pagecache import evict_file, process_read_bytes
from weightstream.store.presets import preset_config
from weightstream.store.synth import synthesize


def test_a_cold_expert_is_counted_once_and_a_cached_one_not(tmp_path):
    out = str(tmp_path / "model")
    synthesize(out, preset_config("tiny", "olmoe"), dtype="bf16", seed=3)
    _, layout = read_layout(out)
    for path in sorted({p.path for e in layout.experts.values() for p in e.pieces}):
        evict_file(path)
    if process_read_bytes() is None:
        pytest.skip("this kernel keeps no per-process I/O count (/proc/self/io, task I/O accounting): nothing to count")
    source = PageCacheSource(layout)
    assert source.reads_counted and source.bytes_read == 0
    key = next(iter(layout.experts))
    nbytes = layout.experts[key].nbytes
    touched = sum(float(t.float().sum()) for t in source.params(*key).values())  # fault every page in
    first = source.bytes_read
    assert first >= nbytes - 4096 > 0  # its bytes, with whatever readahead brought around them
    again = sum(float(t.float().sum()) for t in source.params(*key).values())
    assert again == touched and source.bytes_read == first  # served from the page cache: nothing read
    source.close()
