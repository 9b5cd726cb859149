"""The `weightstream` subcommands: argument parsing and printing only; the work is in the packages.

Each subcommand's module defines `register(subparsers)`; cli.py lists them.
- bench: `weightstream bench`, decode under a memory limit, expert cache against page cache and accelerate;
- clockfloor: `weightstream clockfloor`, the GPU's minimum clock held up while CPU-expert inference decodes;
- demo: `weightstream demo`, a small checkpoint built and streamed at several cache sizes;
- generate: `weightstream generate`, greedy generation with experts streamed from disk;
- import_gguf: `weightstream import`, a GGUF file as a model directory;
- prefetch: `weightstream prefetch record|run`, a loader's read order learned once and replayed ahead of it;
- quantize: `weightstream quantize`, experts (and dense linears) stored as the engine computes them;
- serve: `weightstream serve`, the OpenAI-compatible HTTP server;
- simulate: `weightstream simulate`, a routing trace replayed through cache policies at several sizes;
- synth: `weightstream synth`, a synthetic MoE checkpoint with a local tokenizer;
- trace: `weightstream trace`, routing dumps imported, routing recorded, a trace summarised;
- tune: `weightstream tune`, what to run with this much memory and how fast it will be;
- common: options and output shared by several subcommands (the engine's settings, the one-line run summary);
- tune_report: `tune`'s answer printed (table, lines, --json, plot); the session and the answer are tune/session.py and
  tune/report.py.
"""
