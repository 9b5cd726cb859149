"""Trace replay through cache policies: the reference path (the runtime's own code) and compiled fast paths.

replay: `replay`/`simulate` over policies and sizes; workload: a trace prepared for replay; kernels and
kernels_heap: numba replays held by tests to the reference's decisions; belady: the optimum (it reads the
future); sizes: size lists and ranges; cost_model: time per token from MiB read (bench's linear fit); plot: bytes read
(and tune's predicted tok/s) against cache size. For `tune`: budget: memory divided into dense, KV, overhead and
experts; overlap_model: time per step with reads overlapped with compute, and its fit from calibration timings;
tune: the search over policies, sizes and the page cache; advice: recommendation, page cache vs expert cache,
llama.cpp lines.
"""

from weightstream.sim.replay import SIM_POLICIES, Options, Result, replay, simulate
from weightstream.sim.workload import Workload

__all__ = ["SIM_POLICIES", "Options", "Result", "Workload", "replay", "simulate"]
