"""Routing traces: the format, a builder engines append to, save/load, and importers of third-party dumps."""

from weightstream.trace.format import PHASES, Trace, TraceWriter
from weightstream.trace.npz import load, save
from weightstream.trace.shapes import ModelShape, resolve_shape, shape_from_config

__all__ = [
           "PHASES",
           "ModelShape",
           "Trace",
           "TraceWriter",
           "load",
           "resolve_shape",
           "save",
           "shape_from_config",
]
