"""Load templates: model loading cold, plain vs under `weightstream prefetch run`, with ample memory and in a memory
cgroup limited to 45% of the checkpoint (plus the loader's own anonymous memory).

usage: python benchmarks/prefetch_bench.py [--gib N] [--loaders a,b] [--reps N] [--keep] [--json FILE]
Default size 1 GiB; WEIGHTSTREAM_SLOW=1 makes it 8 GiB. Prints one JSON document on stdout (and writes it to
--json), progress on stderr. Every figure is from this run; ratios compare runs interleaved in the same session.
The synthetic checkpoint, the loaders and the timing live in common/prefetch_*.py.

One part runs by name instead:

    variants   prefetch settings side by side on one loader, each a cold run, rounds interleaved:
               python benchmarks/prefetch_bench.py variants --help
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.prefetch_checkpoint import build  # noqa: E402
from common.prefetch_measure import (  # noqa: E402
    Outcome,
    buffered_read_bandwidth,
    direct_read_bandwidth,
    global_drop_note,
    loader_argv,
    make_cold,
    mem_available,
    still_cached,
    timed,
    weight_files,
)
from common.results import default, save  # noqa: E402

from weightstream.cgroup import MemoryCgroup  # noqa: E402
from weightstream.prefetch.template import LoadTemplate  # noqa: E402

GIB = 1 << 30
LOADERS = ("safetensors", "transformers", "runai", "fastsafetensors")
LIMIT_SHARE = 0.45


def say(msg: str) -> None:
    print(f"[prefetch-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_env(home: Path) -> dict:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return dict(
        os.environ,
        WEIGHTSTREAM_HOME=str(home),
        PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        TOKENIZERS_PARALLELISM="false",
    )


class LoaderBench:
    """All runs of one loader over one checkpoint."""

    def __init__(self, loader: str, model: Path, env: dict, reps: int, work: Path) -> None:
        self.loader, self.model, self.env, self.reps, self.work = loader, model, env, reps, work
        self.bytes = sum(os.path.getsize(p) for p in weight_files(model))
        self.spec = ["--spec", "bench=prefetch", f"loader={loader}", f"bytes={self.bytes}"]
        self.report = work / f"report-{loader}.json"
        self.runs: list[dict] = []

    def cold(self, kind: str, prefetch: bool, cgroup: MemoryCgroup | None = None, extra: tuple = ()) -> Outcome:
        left = make_cold(self.model)
        argv = loader_argv(self.loader, self.model)
        if prefetch:
            argv = [
                sys.executable,
                "-m",
                "weightstream.cli",
                "prefetch",
                "run",
                *self.spec,
                *extra,
                "--json-report",
                str(self.report),
                "--",
                *argv,
            ]
        out = timed(argv, self.env, self.report if prefetch else None, cgroup)
        self.runs.append({"kind": kind, "prefetch": prefetch, "left_cached": left, **out.__dict__})
        say(f"{self.loader} {kind} {'prefetch' if prefetch else 'plain'}: {out.wall_s:.2f} s (rc {out.returncode})")
        return out

    def record(self) -> dict:
        make_cold(self.model)
        argv = [
            sys.executable,
            "-m",
            "weightstream.cli",
            "prefetch",
            "record",
            *self.spec,
            "--model-dir",
            str(self.model),
            "--",
            *loader_argv(self.loader, self.model),
        ]
        out = timed(argv, self.env)
        template = self._template()
        size = template.stat().st_size if template else None
        read = LoadTemplate.from_json(template.read_text()).bytes if template else 0
        say(f"{self.loader} record: {out.wall_s:.2f} s, rc {out.returncode}, template {size} bytes")
        return {
            "wall_s": out.wall_s,
            "returncode": out.returncode,
            "template_bytes": size,
            "template_read_bytes": read,
            "template_bytes_per_gib": size / (self.bytes / GIB) if size else None,
            "stderr": out.stderr_tail,
        }

    def _template(self) -> Path | None:
        for p in (Path(self.env["WEIGHTSTREAM_HOME"]) / "templates").glob("*.json"):
            if f'"loader":"{self.loader}"' in p.read_text():
                return p
        return None

    def rounds(self, kind: str, variants: dict[str, tuple | None], cgroup_limit: int | None = None) -> dict:
        """reps rounds of every variant (None: plain; a tuple: prefetch with those options), rotating the order
        each round so that no variant always runs first."""
        out: dict[str, list[Outcome]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(self.reps):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                cg = MemoryCgroup.create(cgroup_limit, name="ws-bench") if cgroup_limit else None
                try:
                    extra = variants[name]
                    out[name].append(self.cold(f"{kind} {name}", extra is not None, cg, extra or ()))
                finally:
                    if cg:
                        cg.remove()
        return out


def _median(outs: list[Outcome], key=lambda o: o.wall_s) -> float | None:
    ok = [key(o) for o in outs if o.returncode == 0]
    return round(statistics.median(ok), 3) if ok else None


def _reduction(plain: float | None, pf: float | None) -> float | None:
    return round(1 - pf / plain, 3) if plain and pf else None


def _profile(outs: list[Outcome]) -> dict:
    ok = [o for o in outs if o.returncode == 0]
    if not ok:
        return {"error": outs[0].stderr_tail if outs else "no runs"}
    o = ok[len(ok) // 2]
    prof = {k: o.loader.get(k) for k in ("import_s", "load_s", "cpu_s", "peak_anon")}
    prof.update(wall_s=round(o.wall_s, 3), tree_cpu_s=round(o.cpu_s, 3), cgroup_peak=o.cgroup_peak)
    if o.report:
        prof["prefetch"] = {
            k: v
            for k, v in o.report.items()
            if k.startswith("bytes_") or k in ("template_used", "source", "memory_budget", "peak_ahead", "load_seconds")
        }
    return prof


def enough_memory(lb: LoaderBench, wait_s: float = 120) -> bool:
    """Loaders that copy the weights into their own memory need the checkpoint twice over (anon + page cache);
    on a shared machine, wait a little for it, else skip."""
    need = int(lb.bytes * (2.2 if lb.loader != "safetensors" else 1.2))
    deadline = time.monotonic() + wait_s
    while mem_available() < need and time.monotonic() < deadline:
        time.sleep(5)
    return mem_available() >= need


def run_loader(lb: LoaderBench, bandwidth: float) -> dict:
    if not enough_memory(lb):
        return {"error": f"skipped: less than the {lb.bytes * 2.2 / GIB:.1f} GiB it needs was available"}
    warm_up = lb.cold("warm-up", False)
    if warm_up.returncode != 0:
        return {"error": f"loader does not run here: {warm_up.stderr_tail}"}
    rec = lb.record()
    if rec["returncode"] != 0 or (rec["template_read_bytes"] or 0) < lb.bytes // 100:
        ample = lb.rounds("ample", {"plain": None, "prefetch": ()})
        outs = ample["plain"] + ample["prefetch"]
        return {
            "record": rec,
            "bypasses_page_cache": True,
            "plain_s": _median(ample["plain"]),
            "prefetch_s": _median(ample["prefetch"]),
            "checksum": sorted({o.loader.get("checksum") for o in outs}),
            "spread_s": {k: sorted(round(o.wall_s, 2) for o in v) for k, v in ample.items()},
            "profile": {k: _profile(v) for k, v in ample.items()},
            "note": "the loader reads the weights with O_DIRECT: nothing for page-cache prefetch to do",
            "runs": [{k: v for k, v in r.items() if k != "stderr_tail"} for r in lb.runs],
        }
    ample = lb.rounds("ample", {"plain": None, "prefetch": ()})
    timed(loader_argv(lb.loader, lb.model), lb.env)  # warm the cache
    warm = [timed(loader_argv(lb.loader, lb.model), lb.env) for _ in range(max(1, lb.reps))]
    anon = max(o.loader.get("peak_anon", 0) for o in ample["plain"] + warm if o.returncode == 0)
    limit = int(anon + LIMIT_SHARE * lb.bytes)
    gap = str(min(GIB, lb.bytes // 4))  # must exceed what the loader holds between read and use (a MoE layer)
    limited = lb.rounds(
        "limited",
        {"plain": None, "prefetch": ("--reclaim-gap", gap), "prefetch-no-reclaim": ("--reclaim-gap", "none")},
        limit,
    )
    return summarise(lb, bandwidth, rec, ample, warm, limit, limited)


def summarise(lb, bandwidth, rec, ample, warm, limit, limited) -> dict:
    plain, pf = ample["plain"], ample["prefetch"]
    lim_plain, lim_pf, lim_nobar = limited["plain"], limited["prefetch"], limited["prefetch-no-reclaim"]
    checks = {o.loader.get("checksum") for o in plain + pf + warm + lim_plain + lim_pf + lim_nobar if o.returncode == 0}
    t_plain, t_pf, t_warm = _median(plain), _median(pf), _median(warm)
    bound = max(lb.bytes / bandwidth, t_warm or 0)
    load = lambda o: o.loader.get("load_s", 0)  # noqa: E731
    return {
        "bytes": lb.bytes,
        "record": rec,
        "checksums_identical": len(checks) == 1,
        "checksum": sorted(checks),
        "ample": {
            "plain_s": t_plain,
            "prefetch_s": t_pf,
            "reduction": _reduction(t_plain, t_pf),
            "plain_load_phase_s": _median(plain, load),
            "prefetch_load_phase_s": _median(pf, load),
            "load_phase_reduction": _reduction(_median(plain, load), _median(pf, load)),
        },
        "warm_s": t_warm,
        "bound_s": round(bound, 3),
        "best_possible_reduction": _reduction(t_plain, bound),
        "limited": {
            "limit_bytes": limit,
            "plain_s": _median(lim_plain),
            "prefetch_s": _median(lim_pf),
            "reduction": _reduction(_median(lim_plain), _median(lim_pf)),
            "prefetch_no_reclaim_s": _median(lim_nobar),
            "no_reclaim_reduction": _reduction(_median(lim_plain), _median(lim_nobar)),
            "failures": [(o.returncode, o.stderr_tail) for o in lim_plain + lim_pf + lim_nobar if o.returncode],
        },
        "spread_s": {
            name: sorted(round(o.wall_s, 2) for o in outs)
            for name, outs in (
                ("plain", plain),
                ("prefetch", pf),
                ("warm", warm),
                ("limited plain", lim_plain),
                ("limited prefetch", lim_pf),
                ("limited prefetch no reclaim", lim_nobar),
            )
        },
        "profile": {
            "plain": _profile(plain),
            "prefetch": _profile(pf),
            "warm": _profile(warm),
            "limited_plain": _profile(lim_plain),
            "limited_prefetch": _profile(lim_pf),
            "limited_prefetch_no_reclaim": _profile(lim_nobar),
        },
        "runs": [{k: v for k, v in r.items() if k != "stderr_tail"} for r in lb.runs],
    }


def device(model: Path) -> dict:
    paths, limit = weight_files(model), 2 * GIB
    make_cold(model)
    direct = direct_read_bandwidth(paths, limit)
    make_cold(model)
    buffered = buffered_read_bandwidth(paths, limit)
    make_cold(model)
    return {
        "direct_4x1MiB_Bps": round(direct),
        "buffered_sequential_Bps": round(buffered),
        "bytes_measured": min(limit, sum(os.path.getsize(p) for p in paths)),
        "left_cached_after_drop": still_cached(model),
        "global_drop_caches": global_drop_note(),
    }


def main() -> int:
    if sys.argv[1:2] == ["variants"]:
        return variants_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=8.0 if os.environ.get("WEIGHTSTREAM_SLOW") == "1" else 1.0)
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--reps", type=int, default=1 if os.environ.get("WEIGHTSTREAM_SLOW") == "1" else 3)
    p.add_argument("--work", type=Path, default=Path(".work/bench-prefetch"))
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (it is deleted by default)")
    p.add_argument("--json", default=default("prefetch.json"), help="result file (default: %(default)s)")
    args = p.parse_args()
    return bench(args)


def bench(args) -> int:
    work = args.work.resolve()
    model = work / f"moe-{args.gib:g}g"
    say(f"building a {args.gib:g} GiB synthetic qwen3_moe checkpoint in {model}")
    t0 = time.monotonic()
    build(model, int(args.gib * GIB))
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "command": " ".join(sys.argv),
        "checkpoint": {"dir": str(model), "build_s": round(time.monotonic() - t0, 1)},
    }
    doc["device"] = device(model)
    bandwidth = max(doc["device"]["direct_4x1MiB_Bps"], doc["device"]["buffered_sequential_Bps"])
    env = bench_env(work / "home")
    doc["loaders"] = {}
    try:
        for name in args.loaders.split(","):
            doc["loaders"][name] = run_loader(LoaderBench(name, model, env, args.reps, work), bandwidth)
    finally:
        shutil.rmtree(work / "home", ignore_errors=True)
        if not args.keep:
            make_cold(model)
            shutil.rmtree(model, ignore_errors=True)
    text = json.dumps(doc, indent=1)
    print(text)
    save(text, args.json)
    return 0


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "mem_available": mem_available(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "disk": "virtio /dev/vda, ext4",
    }


VARIANTS_DOC = """Prefetch settings side by side on one loader: each variant a cold run, interleaved over rounds, with
ample memory or inside a memory cgroup limited to the loader's peak anonymous memory + 45% of the checkpoint (as
the main benchmark's capped runs). For trying budgets and reclaim gaps; the main benchmark runs every loader.

    .venv/bin/python benchmarks/prefetch_bench.py variants --loader safetensors --gib 8 --cap --reps 2 \\
        --variant plain= --variant gap1g=--reclaim-gap,1GiB \\
        --variant burn-only=--memory-budget,2MiB,--reclaim-gap,256MiB

A variant is NAME=ARGS (comma-separated `prefetch run` options); an empty ARGS after `plain` means no prefetch.
A variant whose name ends in `-text` runs with WEIGHTSTREAM_TRACE_TEXT=1 (the kernel's text trace instead of
the binary ring-buffer pages). Prints JSON (and writes it to --json): per variant the wall seconds, the process
tree's CPU seconds, the loader's own load and CPU seconds, and the prefetch report's byte counters.
"""


def variants_main(argv: list[str]) -> int:
    """Prefetch settings side by side on one loader (the `variants` part: VARIANTS_DOC)."""
    p = argparse.ArgumentParser(
        prog="prefetch_bench.py variants",
        description=VARIANTS_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--loader", default="safetensors")
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--cap", action="store_true", help="run inside the 45%% memory cgroup (else ample memory)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS")
    p.add_argument("--work", type=Path, default=Path(".work/bench-prefetch"))
    p.add_argument("--json", default=default("prefetch-variants.json"), help="result file (default: %(default)s)")
    args = p.parse_args(argv)
    variants = {}
    for v in args.variant or ["plain=", "prefetch=--reclaim-gap,1GiB"]:
        name, _, opts = v.partition("=")
        variants[name] = None if name == "plain" else tuple(o for o in opts.split(",") if o)
    work = args.work.resolve()
    model = work / f"moe-{args.gib:g}g"
    build(model, int(args.gib * GIB))
    lb = LoaderBench(args.loader, model, bench_env(work / "home"), args.reps, work)
    cold = lb.cold

    def cold_with_env(kind, prefetch, cgroup=None, extra=()):
        lb.env["WEIGHTSTREAM_TRACE_TEXT"] = "1" if kind.endswith("-text") else "0"
        return cold(kind, prefetch, cgroup, extra)

    lb.cold = cold_with_env
    lb.cold("warm-up", False)
    rec = lb.record()
    timed(loader_argv(lb.loader, lb.model), lb.env)  # warm, then a warm run measures the loader's own memory
    warm = timed(loader_argv(lb.loader, lb.model), lb.env)
    limit = int(warm.loader.get("peak_anon", 0) + LIMIT_SHARE * lb.bytes) if args.cap else None
    out = lb.rounds("limited" if args.cap else "ample", variants, limit)
    keep = (
        "bytes_prefetched",
        "bytes_used",
        "bytes_reclaimed",
        "bytes_reread_after_reclaim",
        "bytes_loader_missed",
        "bytes_evicted_before_use",
        "memory_budget",
        "events",
    )
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "loader": args.loader,
        "bytes": lb.bytes,
        "cgroup_limit": limit,
        "warm_s": warm.wall_s,
        "record": {k: rec[k] for k in ("wall_s", "template_bytes")},
        "variants": {
            name: [
                {
                    "wall_s": round(o.wall_s, 2),
                    "tree_cpu_s": round(o.cpu_s, 2),
                    "loader_load_s": o.loader.get("load_s"),
                    "loader_cpu_s": o.loader.get("cpu_s"),
                    "prefetch": {k: o.report.get(k) for k in keep} if o.report else None,
                }
                for o in outs
            ]
            for name, outs in out.items()
        },
    }
    text = json.dumps(doc, indent=1)
    print(text)
    save(text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
