"""Routing traces: which experts each token chose in each MoE layer.

- format: the Trace arrays, validation and TraceWriter (what engines append to);
- npz: the file format;
- shapes: the model shape a trace belongs to (named real models or a config.json);
- importers: third-party dumps;
- remap: a trace replayed on another model's shape, as the engine replays it.
"""

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
