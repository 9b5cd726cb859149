"""Trace replay through cache policies: reference path (the runtime's code) and compiled fast paths."""

from weightstream.sim.replay import SIM_POLICIES, Options, Result, replay, simulate
from weightstream.sim.workload import Workload

__all__ = ["SIM_POLICIES", "Options", "Result", "Workload", "replay", "simulate"]
