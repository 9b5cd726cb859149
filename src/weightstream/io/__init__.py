"""Bytes from disk into memory, and the page cache seen per file.

- aligned: page-aligned arenas and aligned-span arithmetic;
- reader: O_DIRECT reads by dedicated I/O threads, demand before read-ahead, buffered where a filesystem refuses
  O_DIRECT;
- pagecache: cachestat/mincore residency, evicting a file's (or a range's) pages, and this process's bytes read;
- leases: read leases on files the process maps, told before another process writes or truncates one.
"""
