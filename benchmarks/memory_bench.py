"""What the engine does with a memory budget, each against its baseline in the same run: the cache `--memory` sizes
in a cgroup, a warm restart, and small copies of missed experts (`--miss-copy`).

    budget         `--memory`: the cache the engine sizes in a cgroup, tok/s, bytes a token, kills (root); against
                   fixed caches in the same cgroup, rounds alternating
    warm-restart   the first tokens after a restart with `--warm-restart`, against the previous run's steady state
                   and a cold restart
    miss-bits      `--miss-copy` against exact mode at the same caches: `timing` (bytes a token and tok/s in a
                   cgroup, root) and `perplexity` (the trained small MoEs)

    .venv/bin/python benchmarks/memory_bench.py budget MODEL --memory 1GiB --caches 1x,2x --trace .work/ds.npz
    .venv/bin/python benchmarks/memory_bench.py warm-restart MODEL --trace .work/ds.npz --rounds 3
    .venv/bin/python benchmarks/memory_bench.py miss-bits timing MODEL --memory 1GiB --trace .work/ds.npz
    .venv/bin/python benchmarks/memory_bench.py miss-bits perplexity --arch deepseek_v3 --miss-bits 2,3

Each prints one JSON object and writes it to --out. The subcommands run parts/memory_budget.py,
parts/warm_restart.py and parts/miss_bits.py; `memory_bench.py PART --help`.
"""

from __future__ import annotations

from common import Part, entry

PARTS = {
    "budget": Part("memory_budget", "the cache --memory sizes in a cgroup, against fixed caches (root)"),
    "warm-restart": Part("warm_restart", "the first tokens after --warm-restart, against steady state and cold"),
    "miss-bits": Part("miss_bits", "--miss-copy against exact mode: timing (root) and perplexity"),
}

if __name__ == "__main__":
    entry("memory_bench.py", __doc__, PARTS)
