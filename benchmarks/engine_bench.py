"""The streaming engine's decode: at several cache sizes, under a memory limit (sweeps around `weightstream bench`,
which gives the headline figures itself), and its expert compute, each against its baseline in the same run.

    cache-sizes    decode tok/s, hit rate and MiB read a token at several cache sizes, against transformers with
                   every weight in memory
    pipeline       one pipeline setting varied at a time under a memory limit, against the engine's defaults
    limits         expert cache against the page cache at several memory limits
    predict-next   next-layer prediction (read-ahead) on against off, interleaved repeats
    plot           decode tok/s against expert-cache size from `weightstream bench --json` reports (a PNG)
    compute        expert compute with every expert resident against transformers eager (and llama.cpp bf16 with
                   --llamacpp); both kernels under a memory limit; --profile: a decode token by torch op

    .venv/bin/python benchmarks/engine_bench.py cache-sizes --preset olmoe-1b-7b --layers 16 --tokens 32
    .venv/bin/python benchmarks/engine_bench.py pipeline MODEL --memory-limit 5GiB --expert-cache 1x --repeats 2
    .venv/bin/python benchmarks/engine_bench.py limits MODEL --limits 3GiB,4GiB,5GiB,6GiB --plot limits.png
    .venv/bin/python benchmarks/engine_bench.py predict-next --model MODEL --trace .work/ds.npz --caches 1x,2x
    .venv/bin/python benchmarks/engine_bench.py compute MODEL --llamacpp --memory-limit 5GiB --caches 1x,2x --profile

Each prints one JSON object and writes it to --out (benchmarks/results/, named by capability). The subcommands run
parts/engine_cache_sizes.py, parts/bench_sweep.py (pipeline, limits), parts/predict_next.py,
parts/plot_bench.py and parts/expert_compute.py; `engine_bench.py PART --help`.
"""

from __future__ import annotations

from common import Part, entry

PARTS = {
    "cache-sizes": Part("engine_cache_sizes", "decode at several cache sizes, against transformers in memory"),
    "pipeline": Part("bench_sweep", "one pipeline setting varied at a time under a memory limit", named=True),
    "limits": Part("bench_sweep", "expert cache against the page cache at several memory limits", named=True),
    "predict-next": Part("predict_next", "next-layer prediction on against off"),
    "plot": Part("plot_bench", "decode tok/s against expert-cache size from `weightstream bench --json` reports"),
    "compute": Part("expert_compute", "expert compute against transformers eager and llama.cpp; under a limit"),
}

if __name__ == "__main__":
    entry("engine_bench.py", __doc__, PARTS)
