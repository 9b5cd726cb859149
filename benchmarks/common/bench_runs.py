"""One `weightstream bench` run of some expert caches under a memory cgroup, read back as a figure per cache: the
part `memory_bench.py budget` and `miss-bits` share."""

from __future__ import annotations

import json
import subprocess
import sys

MIB = 2**20


def bench_caches(args, caches: list[str], extra: list[str] | None = None) -> dict[str, dict]:
    """`weightstream bench args.model --memory-limit args.memory --expert-cache CACHES` (expert-cache mode, no
    reference, no overlap check, no long prefill; `args.trace` replayed if given; `extra` options appended):
    cache -> its run's common figures, with the run itself under "run"."""
    cmd = [sys.executable, "-m", "weightstream.cli", "bench", args.model, "--memory-limit", args.memory]
    cmd += ["--expert-cache", ",".join(caches), "--modes", "expert-cache", "--no-reference", "--no-overlap"]
    cmd += ["--prefill-tokens", "0", "--max-new-tokens", str(args.max_new_tokens), "--json"]
    cmd += ["--routing-trace", args.trace] if args.trace else []
    cmd += extra or []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: {done.stderr[-2000:]}")
    out = {}
    for run in json.loads(done.stdout)["runs"]:
        out[run["expert_cache"]] = {
            "error": run.get("error"),
            "expert_cache_mib": (run.get("expert_cache_bytes") or 0) / MIB,
            "decode_tokens_per_s": run.get("decode_tokens_per_s"),
            "mib_read_per_token": (run.get("decode_bytes_read_per_token") or 0) / MIB,
            "hit_rate": run.get("expert_hit_rate"),
            "cgroup_peak_mib": (run.get("cgroup_peak_bytes") or 0) / MIB,
            "run": run,
        }
    return out
