"""Plot decode tok/s against expert cache size from `weightstream bench --json` reports (direct points per cache
size; page-cache, which has no cache of its own, as a line at the same memory limit).

    .venv/bin/python benchmarks/engine_bench.py plot own.json replay.json --out docs/bench-tok-s-vs-cache.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, path in enumerate(args.reports):
        report = json.load(open(path))
        label = "model's own routing" if report["routing"].startswith("the model") else "DeepSeek routing replayed"
        ok = [r for r in report["runs"] if "error" not in r]
        cached = sorted(
            (r["expert_cache_bytes"] / 2**30, r["decode_tokens_per_s"])
            for r in ok
            if r["mode"] in ("expert-cache", "direct")
        )  # "direct": reports made before the rename
        color = f"C{i}"
        ax.plot(*zip(*cached), "o-", color=color, label=f"expert-cache ({label})")
        for r in ok:
            if r["mode"] == "page-cache":
                ax.axhline(r["decode_tokens_per_s"], color=color, ls="--", label=f"page-cache ({label})")
    limit = json.load(open(args.reports[0]))["memory_limit_bytes"] / 2**30
    ax.set_xlabel(f"expert cache (GiB); every run limited to {limit:.1f} GiB including the page cache")
    ax.set_ylabel("decode tokens / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
