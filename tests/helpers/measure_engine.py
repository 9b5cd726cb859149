"""Child process for memory and I/O tests: load, generate, print JSON with RSS and /proc/self/io figures."""

import json
import os
import sys

import psutil
import torch
import transformers  # noqa: F401  (imported before the baseline so its size is not counted as engine memory)

from weightstream.bench.child import peak_rss
from weightstream.io.pagecache import process_read_bytes as io_read_bytes


def page_in_mapped_files(skip_dir: str) -> None:
    """Read every file this process maps (its libraries) into the page cache. A code page first run during the
    measured window would otherwise be a disk read that /proc/self/io counts, whenever something (drop_caches,
    memory pressure) evicted it: libtorch_cpu.so pages did exactly that here."""
    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/" in line}
    for path in sorted(paths):
        if path.startswith(os.path.abspath(skip_dir)) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def main(model_dir: str, cache: str, threads: int, tokens: int, predict_next: bool = False) -> None:
    from weightstream.engine.generate import generate
    from weightstream.engine.loader import load_streaming_model

    baseline = psutil.Process().memory_info().rss
    model = load_streaming_model(model_dir, expert_cache=cache, io_threads=threads, predict_next=predict_next)
    generate(model, torch.tensor([[1, 2]]), 2)  # warm-up: lazy imports read files too; keep them out of the count
    page_in_mapped_files(model_dir)
    before, reader_before = io_read_bytes(), model.weightstream.cache.bytes_read
    _, stats = generate(model, torch.tensor([[5, 6, 7, 8]]), tokens)
    model.weightstream.close()  # joins the I/O threads: a read-ahead issued in the last step has landed too
    after = io_read_bytes()
    layout = model.weightstream.layout
    print(
        json.dumps(
            {
                "baseline_rss": baseline,
                "peak_rss": peak_rss(),
                "dense_bytes": sum(t.nbytes for t in layout.dense.values()),
                "expert_total": layout.expert_bytes_total(),
                "cache_bytes": model.weightstream.cache.memory_bytes,
                "budget": model.weightstream.cache.budget_bytes,
                "proc_read_bytes": after - before,
                "reader_bytes_read": model.weightstream.cache.bytes_read - reader_before,
                "stats": stats.to_dict(),
                "aligned_bytes_missed": model.weightstream.cache.stats.aligned_bytes_missed,
                "readahead_aligned_bytes": model.weightstream.cache.stats.readahead_aligned_bytes,
                "expert_nbytes": sorted({e.nbytes for e in layout.experts.values()}),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["--predict-next"])
