"""weightstream: application-aware LLM weight I/O."""

__version__ = "0.1.0"
