"""Cold starts for measurement: a model's files out of the page cache, and the whole page cache where allowed."""

from __future__ import annotations

from weightstream.io.pagecache import evict_file

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache(paths: list[str]) -> bool:
    """Evict the files' pages, then the system's clean page cache when permitted (root); True if system-wide.

    Per-file eviction leaves pages some process still maps; the system-wide drop also clears what other files
    left behind (a tokenizer, libraries), so every measured run starts equally cold.
    """
    for path in paths:
        evict_file(path)
    return drop_system_page_cache() is None


def drop_system_page_cache() -> str | None:
    """Write 1 to /proc/sys/vm/drop_caches; None when done, else why not, in words."""
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1")
        return None
    except OSError as exc:
        return f"{DROP_CACHES} refused ({exc.strerror}); dropped per file only"
