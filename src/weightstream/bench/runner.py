"""`weightstream bench`: each configuration in its own process inside a memory cgroup, cold page cache,
device read counters before and after, tokens compared with a reference, and a fitted cost model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

from weightstream.bench.coldstart import drop_page_cache
from weightstream.bench.machine import block_device_of, device_bytes_read, machine_info
from weightstream.bench.overlap import OVERLAP_TARGET, judge_overlap, reader_bandwidth
from weightstream.bench.reclaim import paused_proactive_reclaim
from weightstream.cache.sizes import DEFAULT_UPGRADE_AFTER
from weightstream.cgroup import MemoryCgroup
from weightstream.errors import WeightstreamError
from weightstream.sim.cost_model import fit_cost_model
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.quant.manifest import read_manifest
from weightstream.units import GIB, MIB

MODES = ("expert-cache", "page-cache", "accelerate")
MODE_ALIASES = {"direct": "expert-cache"}  # the name before 0.2, kept for scripts


@dataclass(slots=True)
class BenchConfig:
    model_dir: str
    memory_limit: int
    expert_caches: list[str]
    modes: list[str]
    prompts: list[list[int]]
    max_new_tokens: int = 32
    routing_trace: str | None = None
    io_threads: int = 4
    compute_threads: int | None = None
    chunk_bytes: int | None = None
    reference: bool = True
    predict_next: bool = False
    miss_copy: bool = False  # expert-cache runs read small copies on a miss (`--miss-copy`)
    upgrade_after: int | None = (
        DEFAULT_UPGRADE_AFTER  # --miss-copy: the hit on a small copy that reads the full blob (None: never)
    )
    expert_kernel: str = "auto"
    long_prompt: list[int] | None = None  # its prefill is timed in expert-cache and page-cache runs
    overlap: bool = True  # measure the reader's bandwidth and compute-only decode, and judge each expert-cache run
    policy: str = "lru"  # expert-cache runs' policy
    pinned_experts: str | None = None  # policy pinned: the file of experts to keep
    extra: dict = field(default_factory=dict)


def canonical_mode(mode: str) -> str:
    """A --modes entry in today's name; an error listing the modes when it is none of them."""
    mode = MODE_ALIASES.get(mode, mode)
    if mode not in MODES:
        raise WeightstreamError(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return mode


def run_child(cfg: dict, cgroup: MemoryCgroup | None) -> tuple[dict | None, str, int]:
    args = [sys.executable, "-m", "weightstream.bench.child"]
    kwargs = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = cgroup.popen(args, **kwargs) if cgroup else subprocess.Popen(args, **kwargs)
    out, err = proc.communicate(json.dumps(cfg))
    if proc.returncode != 0:
        return None, err, proc.returncode
    return json.loads(out.strip().splitlines()[-1]), err, 0


def measure(config: BenchConfig, mode: str, cache: str, files: list[str], device: str) -> dict:
    """One configuration: cold cache, own cgroup, device bytes before and after."""
    cfg = child_config(config, mode, cache)
    if mode == "accelerate" and read_manifest(config.model_dir) is not None:
        return {
            "mode": mode,
            "error": "accelerate's offload runs transformers, which cannot load weightstream's "
            "quantized experts; bench the source checkpoint for it",
        }
    if mode == "accelerate" and config.routing_trace:
        return {
            "mode": mode,
            "error": "routing replay is not available for accelerate's offload (its experts "
            "run transformers' own code with the model's router); run without --routing-trace",
        }
    with paused_proactive_reclaim() as paused:  # the limit decides what stays cached, not idle-page reclaim
        dropped_globally = drop_page_cache(files)
        before = device_bytes_read(device)
        group = MemoryCgroup.create(config.memory_limit, name=f"ws-bench-{mode}")
        start = time.perf_counter()
        try:
            result, err, rc = run_child(cfg, group)
            peak, pressure = group.peak_bytes, group.pressure
        finally:
            group.remove()
            shutil.rmtree(cfg["offload_dir"], ignore_errors=True)
    after = device_bytes_read(device)
    run = {
        "mode": mode,
        "expert_cache": cache if mode == "expert-cache" else None,
        "policy": config.policy if mode == "expert-cache" else None,
        "miss_copy": config.miss_copy and mode == "expert-cache",
        "upgrade_after": config.upgrade_after if config.miss_copy and mode == "expert-cache" else None,
        "wall_s": time.perf_counter() - start,
        "proactive_reclaim_paused": paused,
        "cgroup_peak_bytes": peak,
        "cgroup_pressure": pressure,
        "page_cache_dropped_globally": dropped_globally,
    }
    if result is None:
        reason = "killed by the memory limit (out of memory)" if rc in (-9, 137) else f"exit {rc}"
        return {**run, "error": f"{reason}: {err.strip().splitlines()[-1] if err.strip() else ''}"}
    return {**run, **summarize(result, None if before is None or after is None else after - before)}


ACCELERATE_TOKENS = 8  # accelerate's offload reads every expert of every layer per token: keep its run short


def child_config(config: BenchConfig, mode: str, cache: str) -> dict:
    short = mode == "accelerate"
    return {
        "mode": mode,
        "model_dir": config.model_dir,
        "expert_cache": cache,
        "memory_limit": config.memory_limit,
        "io_threads": config.io_threads,
        "compute_threads": config.compute_threads,
        "chunk_bytes": config.chunk_bytes,
        "routing_trace": config.routing_trace,
        "prompts": config.prompts[:1] if short else config.prompts,
        "max_new_tokens": min(config.max_new_tokens, ACCELERATE_TOKENS) if short else config.max_new_tokens,
        "predict_next": config.predict_next and mode == "expert-cache",
        "miss_copy": config.miss_copy and mode == "expert-cache",
        "upgrade_after": config.upgrade_after,
        "expert_kernel": config.expert_kernel,
        "policy": config.policy if mode == "expert-cache" else "lru",
        "pinned_experts": config.pinned_experts if mode == "expert-cache" else None,
        "long_prompt": config.long_prompt if mode in ("expert-cache", "page-cache") else None,
        "warm_all": mode == "compute-only",
        "offload_dir": os.path.join(
            os.path.dirname(os.path.abspath(config.model_dir)), f".ws-offload-{os.getpid()}-{mode}"
        ),
    }


def summarize(result: dict, device_bytes: int | None) -> dict:
    prompts = result["prompts"]
    decode_s = sum(p["decode_s"] for p in prompts)
    steps = sum(p.get("decode_steps", p.get("generated_tokens", 1) - 1) for p in prompts)
    tokens = sum(len(p["token_ids"]) for p in prompts)
    long = result.get("long_prefill")
    out = {
        "decode_tokens_per_s": steps / decode_s if decode_s else 0.0,
        "long_prefill": long,
        "prefill_s": sum(p["prefill_s"] for p in prompts) / len(prompts),
        "device_bytes_read": device_bytes,
        "bytes_read_per_token": device_bytes / tokens if device_bytes is not None else None,
        "peak_rss_bytes": result["peak_rss_bytes"],
        "load_s": result["load_s"],
        "token_ids": [p["token_ids"] for p in prompts],
    }
    if result.get("memory"):  # --expert-cache memory: the footprint the engine measured and sized its cache from
        out["memory"] = result["memory"]
    if (
        "expert_hits" in prompts[0] and prompts[0]["expert_cache_bytes"]
    ):  # expert-cache: the page cache has no hit count
        hits, misses = sum(p["expert_hits"] for p in prompts), sum(p["expert_misses"] for p in prompts)
        out.update(
            expert_hit_rate=hits / (hits + misses) if hits + misses else None,
            decode_bytes_read_per_token=_decode_bytes_per_token(prompts, steps),
            engine_bytes_read=sum(p["bytes_read"] for p in prompts),
            io_wait_s=sum(p["io_wait_s"] for p in prompts),
            expert_cache_bytes=result["expert_cache_bytes"],
            expert_misses=misses,
            **_miss_copy_totals(prompts),
            per_prompt=[
                {
                    "decode_s_per_token": p["decode_s"] / max(p["generated_tokens"] - 1, 1),
                    "mib_read_per_token": p["bytes_read_per_token"] / MIB,
                }
                for p in prompts
            ],
        )
    else:
        out["expert_hit_rate"] = None
        if result.get("page_cache_reads_counted"):  # the kernel's count of this process's reads during decode
            out["decode_bytes_read_per_token"] = _decode_bytes_per_token(prompts, steps)
    return out


def _miss_copy_totals(prompts: list[dict]) -> dict:
    """--miss-copy's figures over all prompts (bits 0: exact mode)."""
    keys = ("miss_copy_reads", "miss_copy_bytes_read", "upgrades", "upgrade_bytes_read", "miss_copy_hits")
    return {
        "miss_copy_bits": prompts[0].get("miss_copy_bits", 0),
        **{k: sum(p.get(k, 0) for p in prompts) for k in keys},
    }


def _decode_bytes_per_token(prompts: list[dict], steps: int) -> float:
    """Bytes read per decode step over all prompts (each prompt's own figure leaves its prefill out)."""
    total = sum(p["bytes_read_per_token"] * max(p["generated_tokens"] - 1, 0) for p in prompts)
    return total / steps if steps else 0.0


def reference_tokens(config: BenchConfig, model_bytes: int) -> tuple[list | None, str]:
    """Tokens of transformers fully in memory without the limit, when the machine can hold the model."""
    if config.routing_trace:
        return None, "routing replayed from a trace: tokens are not compared"
    if psutil.virtual_memory().available < 1.3 * model_bytes or not config.reference:
        return None, "first-mode"
    if read_manifest(config.model_dir) is not None:  # transformers cannot load our quantized experts
        mode, kind = "compute-only", "weightstream with every quantized expert resident, no limit"
    else:
        mode, kind = "in-memory", "transformers in memory, no limit"
    result, err, rc = run_child(child_config(config, mode, "1000x"), None)
    if result is None:
        return None, f"first-mode (in-memory reference failed: exit {rc})"
    return [p["token_ids"] for p in result["prompts"]], kind


def run_bench(config: BenchConfig, progress=lambda msg: None) -> dict:
    ckpt = open_checkpoint(config.model_dir)
    config.modes = [canonical_mode(m) for m in config.modes]
    device = block_device_of(config.model_dir)
    progress("reference: transformers in memory")
    reference, reference_kind = reference_tokens(config, ckpt.total_bytes())
    runs = []
    for mode in config.modes:
        for cache in config.expert_caches if mode == "expert-cache" else [None]:
            progress(f"{mode}{' ' + cache if cache else ''}")
            runs.append(measure(config, mode, cache or config.expert_caches[0], ckpt.files, device))
    compare_tokens(runs, reference, reference_kind)
    overlap = (
        measure_overlap(config, ckpt, runs, progress) if config.overlap and "expert-cache" in config.modes else None
    )
    return {
        "machine": machine_info(device),
        "model": config.model_dir,
        "model_bytes": ckpt.total_bytes(),
        "memory_limit_bytes": config.memory_limit,
        "routing": routing_label(config),
        "reference": reference_kind,
        "runs": runs,
        "cost_model": cost_model(runs),
        "overlap": overlap,
    }


def measure_overlap(config: BenchConfig, ckpt, runs: list[dict], progress) -> dict:
    """Each expert-cache run's time per token against max(compute-only time per token, its decode reads / bandwidth).

    Compute-only is the same engine and prompts with every expert already in the cache (no limit: it needs the
    whole model in memory); bandwidth is the reader's own O_DIRECT rate on this checkpoint, cold.
    """
    progress("reader bandwidth (O_DIRECT, cold)")
    bandwidth = reader_bandwidth(config.model_dir, config.io_threads, config.chunk_bytes)
    out = {"reader_bandwidth": bandwidth, "target_ratio": OVERLAP_TARGET}
    experts = sum(t.nbytes for t in ckpt.tensors.values() if ".experts." in t.name)
    if psutil.virtual_memory().available < 1.2 * ckpt.total_bytes():
        out["error"] = (
            f"compute-only needs every expert in memory ({experts / GIB:.1f} GiB of experts); "
            f"this machine has {psutil.virtual_memory().available / GIB:.1f} GiB available"
        )
        return out
    progress("compute-only: every expert resident, no limit")
    result, err, rc = run_child(child_config(config, "compute-only", "1000x"), None)
    if result is None:
        out["error"] = f"compute-only run failed (exit {rc}): {err.strip().splitlines()[-1] if err.strip() else ''}"
        return out
    compute_s = 1 / summarize(result, None)["decode_tokens_per_s"]  # the same decode speed as every run's
    out.update(
        compute_only_s_per_token=compute_s, compute_only_misses=sum(p["expert_misses"] for p in result["prompts"])
    )  # 0: all resident
    out["runs"] = judge_overlap(runs, compute_s, bandwidth)
    return out


def compare_tokens(runs: list[dict], reference, kind: str) -> None:
    ok = [r for r in runs if "token_ids" in r]
    if reference is None and kind.startswith("first-mode") and ok:
        reference = ok[0]["token_ids"]
    for r in runs:
        got = r.get("token_ids")
        # accelerate runs a prefix of the work (first prompt, fewer tokens): compare that prefix
        r["token_ids_equal_to_reference"] = (
            all(g == ref[: len(g)] for g, ref in zip(got, reference)) if reference and got else None
        )


def cost_model(runs: list[dict]) -> dict:
    points = [p for r in runs if r.get("mode") == "expert-cache" for p in r.get("per_prompt", [])]
    model = fit_cost_model([p["mib_read_per_token"] for p in points], [p["decode_s_per_token"] for p in points])
    if model is None:
        return {"error": "needs expert-cache runs with different read volumes: pass several --expert-cache sizes"}
    out = model.to_dict()
    # the line is noise, not a cost: say so rather than let it be used (a term is pinned at 0 where noise tilted the
    # fit below it, `sim.cost_model.fit_line`; tune refuses fixed_s 0, which would price a step at no time)
    if model.per_mib_s <= 0 or model.fixed_s <= 0 or model.r2 < 0.5:
        out["warning"] = (
            f"poor fit (R^2 {model.r2:.2f}, {model.fixed_s * 1000:.1f} ms fixed, {model.per_mib_s * 1000:.3f} ms "
            "per MiB): the runs' read volumes barely differ; pass several --expert-cache sizes (e.g. 1x,1.5x,2x,3x)"
        )
    return out


def routing_label(config: BenchConfig) -> str:
    return f"replay of {config.routing_trace}" if config.routing_trace else "the model's own router"
