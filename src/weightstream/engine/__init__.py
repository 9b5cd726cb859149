"""transformers integration: a model whose experts stream from disk, its generation loop and its measurements.

- config: EngineConfig, every option the engine takes, checked before anything loads;
- loader: builds the transformers model (experts on the meta device, dense weights loaded) around an expert source;
- experts: the experts implementation registered with transformers, and the per-layer step it runs;
- kernels/: expert kernels (eager, quantized), the dense modules on GGML blocks, which kernel an experts module gets;
- file_guard: the model's weight files under read leases, a file written under it an error naming it, not a SIGBUS;
- fused: one native call where transformers runs a chain of small ops (RMSNorm, rotary embedding) in float32;
- latent_attention: DeepSeek's multi-head latent attention absorbed (attention over the cached latent);
- runtime: per-model state (the source, routing hooks, counters);
- shards: experts computed by shards that hold them in other processes (Ray actors), bitwise the one-process sum;
- page_cache_source: experts through mmap (the baseline);
- kv_cache: the KV cache the engine generates with, its buffers sized for the whole generation;
- generate: greedy generation with stats;
- routing: record and replay routing traces;
- predict: next-layer read-ahead guesses;
- batching/: continuous batching (scheduler, sequences, batched decode), which `weightstream serve` puts HTTP in
  front of (weightstream/serve/).
"""

EXPERT_SOURCES = ("expert-cache", "page-cache")  # weightstream's own O_DIRECT cache, or mmap and the page cache
SOURCE_ALIASES = {"direct": "expert-cache", "mmap": "page-cache"}  # the names before 0.2, kept for scripts
