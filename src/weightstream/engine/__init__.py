"""transformers integration: a model whose experts stream from disk, its generation loop and its measurements.

loader: builds the transformers model (experts on the meta device, dense weights loaded) around an expert
source; experts: the experts implementation registered with transformers; runtime: per-model state (the
source, routing hooks, counters); page_cache_source: experts through mmap (the baseline); generate: greedy
generation with stats; routing: record and replay routing traces; predict: next-layer read-ahead guesses;
prompts: prompt files and built-in prompts; serve/: `weightstream serve` (HTTP API, scheduler, batched decode).
"""

EXPERT_SOURCES = ("expert-cache", "page-cache")  # weightstream's own O_DIRECT cache, or mmap and the page cache
SOURCE_ALIASES = {"direct": "expert-cache", "mmap": "page-cache"}  # the names before 0.2, kept for scripts
