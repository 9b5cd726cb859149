"""Trace replay through cache policies: the reference path (the runtime's own code) and compiled fast paths.

- replay: `replay`/`simulate` over policies and sizes;
- workload: a trace prepared for replay;
- kernels: numba replays (LRU distances, SLRU, pinned) held by tests to the reference's decisions;
- kernels_heap: numba LFU and Belady replays on an indexed min-heap, held to the same;
- belady: the optimum as a policy object (it reads the future);
- miss_copy: `--miss-copy` over a replay's hits: small reads, upgrades, small hits (as `ExpertCache` counts them);
- sizes: size lists and ranges;
- cost_model: time per token from MiB read (bench's linear fit);
- plot: bytes read (and tune's predicted tok/s) against cache size;
For `tune`:
- budget: memory divided into dense, KV, overhead and experts;
- overlap_model: time per step with reads overlapped with compute, and its fit from calibration timings;
- page_cache_model: the kernel's page cache under mmap'd experts, over the checkpoint's real byte ranges;
- tune: the search over policies, sizes and the page cache;
- advice: recommendation, page cache vs expert cache, llama.cpp lines (`weightstream tune` itself: tune/).
"""

from weightstream.sim.miss_copy import MissCopy
from weightstream.sim.replay import SIM_POLICIES, Options, Result, replay, simulate
from weightstream.sim.workload import Workload

__all__ = ["SIM_POLICIES", "MissCopy", "Options", "Result", "Workload", "replay", "simulate"]
