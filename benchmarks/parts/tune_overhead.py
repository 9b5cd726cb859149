"""Measure the runtime overhead `tune` budgets for: process memory beyond dense weights + expert cache + KV.

Each model runs in a fresh child process: import torch and transformers, load the streaming engine with a 1x
expert cache, generate from a prompt of --prompt-tokens tokens, then read /proc/self/status. Overhead = peak
resident memory (VmHWM) - the checkpoint's pages mapped in the process (dense weights: safetensors maps them, and
only the pages touched count, so an untied input embedding adds only its used rows; /proc/self/smaps) - the
expert cache's arena - the KV cache the context holds. Also prints what the old formula (all dense bytes
resident) gave and `tune`'s resident dense estimate (`Budget.resident_dense_bytes`). Prints one JSON object;
`sim.budget.RUNTIME_OVERHEAD_BYTES` states the figure measured with it (docs/tune.md).

    .venv/bin/python benchmarks/tune_proof.py overhead MODEL_DIR [MODEL_DIR ...] --prompt-tokens 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common.results import default, save

CHILD = r"""
import json, os, sys
def status():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.split(":")[0] in
                ("VmHWM", "VmRSS", "RssAnon", "RssFile")}
start = status()
import torch, transformers  # noqa: F401
after_import = status()
from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.bench.prompts import long_prompt
from weightstream.store.facts import kv_cache_bytes
model_dir, prompt_tokens, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = load_streaming_model(model_dir, expert_cache="1x")
ids = long_prompt(model_dir, prompt_tokens)
generate(model, torch.tensor([ids]), new_tokens)
model.weightstream.close()
end = status()
layout = model.weightstream.layout
files = {info.path for info in layout.dense.values()} | {p.path for e in layout.experts.values() for p in e.pieces}
files = {os.path.realpath(f) for f in files}
mapped, current = 0, None
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line; the path is its sixth field
            current = os.path.realpath(head[5]) if len(head) >= 6 else None
        elif head and head[0] == "Rss:" and current in files:
            mapped += int(head[1]) * 1024
from weightstream.sim.budget import lazy_dense_bytes
from weightstream.store.facts import ties_embeddings
dense_sizes = {name: t.nbytes for name, t in layout.dense.items()}
dense = sum(dense_sizes.values())
lazy = lazy_dense_bytes(dense_sizes, ties_embeddings(model.config))
cache = model.weightstream.cache.memory_bytes
kv = kv_cache_bytes(model.config.get_text_config(), prompt_tokens + new_tokens, next(model.parameters()).element_size())
print(json.dumps({"model": model_dir, "start": start, "after_import": after_import, "end": end,
                  "dense_bytes": dense, "lazy_dense_bytes": lazy, "checkpoint_mapped_bytes": mapped,
                  "expert_cache_bytes": cache, "kv_cache_bytes": kv,
                  "overhead_peak_bytes": end["VmHWM"] - mapped - cache - kv,
                  "overhead_end_bytes": end["VmRSS"] - mapped - cache - kv,
                  "overhead_peak_bytes_all_dense_resident": end["VmHWM"] - dense - cache - kv,
                  "overhead_peak_bytes_tune_resident_dense": end["VmHWM"] - (dense - lazy) - cache - kv,
                  "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}))
"""


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", metavar="MODEL_DIR")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--out", default=default("tune-overhead.json"), help="result file (default: %(default)s)")
    args = p.parse_args(argv)
    runs = []
    for model in args.models:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, model, str(args.prompt_tokens), str(args.new_tokens)],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    text = json.dumps({"runs": runs, "max_overhead_peak_bytes": max(r["overhead_peak_bytes"] for r in runs)})
    print(text)
    save(text, args.out)
