"""Trace replay through cache policies: the reference path (the runtime's own code) and compiled fast paths.

replay: `replay`/`simulate` over policies and sizes; workload: a trace prepared for replay; kernels and
kernels_heap: numba replays held by tests to the reference's decisions; belady: the optimum (it reads the
future); sizes: size lists and ranges; cost_model: time per token from MiB read; plot: bytes read against
cache size.
"""

from weightstream.sim.replay import SIM_POLICIES, Options, Result, replay, simulate
from weightstream.sim.workload import Workload

__all__ = ["SIM_POLICIES", "Options", "Result", "Workload", "replay", "simulate"]
