"""Measure the runtime overhead `tune` budgets for: process memory beyond dense weights + expert cache + KV.

Each model runs in a fresh child process: import torch and transformers, load the streaming engine with a 1x
expert cache, generate from a prompt of --prompt-tokens tokens, then read /proc/self/status. Overhead = peak
resident memory (VmHWM) - dense bytes - the expert cache's arena - the KV cache the context holds. Prints one
JSON object; `sim.budget.RUNTIME_OVERHEAD_BYTES` states the figure measured with it (docs/tune.md).

    PYTHONPATH=src .venv/bin/python benchmarks/tune_overhead.py MODEL_DIR [MODEL_DIR ...] --prompt-tokens 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys
def status():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.split(":")[0] in
                ("VmHWM", "VmRSS", "RssAnon", "RssFile")}
start = status()
import torch, transformers  # noqa: F401
after_import = status()
from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.engine.prompts import long_prompt
from weightstream.sim.budget import kv_cache_bytes
model_dir, prompt_tokens, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = load_streaming_model(model_dir, expert_cache="1x")
ids = long_prompt(model_dir, prompt_tokens)
generate(model, torch.tensor([ids]), new_tokens)
model.weightstream.close()
end = status()
layout = model.weightstream.layout
dense = sum(t.nbytes for t in layout.dense.values())
cache = model.weightstream.cache.memory_bytes
kv = kv_cache_bytes(model.config.get_text_config(), prompt_tokens + new_tokens, next(model.parameters()).element_size())
print(json.dumps({"model": model_dir, "start": start, "after_import": after_import, "end": end,
                  "dense_bytes": dense, "expert_cache_bytes": cache, "kv_cache_bytes": kv,
                  "overhead_peak_bytes": end["VmHWM"] - dense - cache - kv,
                  "overhead_end_bytes": end["VmRSS"] - dense - cache - kv,
                  "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", metavar="MODEL_DIR")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args()
    runs = []
    for model in args.models:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, model, str(args.prompt_tokens), str(args.new_tokens)],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"runs": runs, "max_overhead_peak_bytes": max(r["overhead_peak_bytes"] for r in runs)}))


if __name__ == "__main__":
    main()
