"""One benchmark configuration, run in its own process (inside the memory cgroup): reads a JSON config on stdin,
prints one JSON result on stdout."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from weightstream.cache.sizes import DEFAULT_UPGRADE_AFTER


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


MEMORY_SIZED = "memory"  # --expert-cache memory: the cache `load_streaming_model(memory=limit)` sizes


def run_streaming(cfg: dict) -> dict:
    from weightstream.engine.generate import generate
    from weightstream.engine.loader import load_streaming_model, read_pinned_experts

    pinned = cfg.get("pinned_experts")
    sized = cfg["mode"] != "page-cache" and cfg["expert_cache"] == MEMORY_SIZED
    longest = max(len(ids) for ids in cfg["prompts"] + ([cfg["long_prompt"]] if cfg.get("long_prompt") else []))
    trace = None
    if cfg.get("routing_trace"):  # read before the model, so that `memory` counts it with what came before
        from weightstream.trace import load

        trace = load(cfg["routing_trace"])
    start = time.perf_counter()
    model = load_streaming_model(
        cfg["model_dir"],
        expert_cache=None if sized else cfg["expert_cache"],
        memory=cfg["memory_limit"] if sized else None,  # the engine sizes its cache to the run's cgroup itself
        context=longest + cfg["max_new_tokens"],
        warmup_tokens=min(longest, 512),
        io_threads=cfg["io_threads"],
        chunk_bytes=cfg.get("chunk_bytes"),
        policy=cfg.get("policy", "lru"),
        policy_options={"pinned_keys": read_pinned_experts(pinned)} if pinned else None,
        expert_source="page-cache" if cfg["mode"] == "page-cache" else "expert-cache",
        predict_next=cfg.get("predict_next", False),
        miss_copy=cfg.get("miss_copy", False),
        upgrade_after=cfg.get("upgrade_after", DEFAULT_UPGRADE_AFTER),
        expert_kernel=cfg.get("expert_kernel", "auto"),
    )
    load_s = time.perf_counter() - start
    runtime = model.weightstream
    if trace is not None:
        from weightstream.engine.routing import RoutingReplay

        runtime.routing_override = RoutingReplay(trace, runtime.layout)
    if cfg.get("warm_all"):  # compute-only: every expert read into the cache before the clock starts
        warm_every_expert(runtime.cache)
    prompts = []
    for _ in range(cfg.get("passes", 1)):
        prompts = []
        for ids in cfg["prompts"]:
            new, stats = generate(model, torch.tensor([ids]), cfg["max_new_tokens"])
            prompts.append(
                {"token_ids": new[0].tolist(), **{k: v for k, v in stats.to_dict().items() if k != "layer_misses"}}
            )
    long_prefill = None
    if cfg.get("long_prompt"):  # a long prompt's prefill: every expert of every layer, read in parallel
        _, stats = generate(model, torch.tensor([cfg["long_prompt"]]), 1)
        long_prefill = {
            "tokens": len(cfg["long_prompt"]),
            "prefill_s": stats.prefill_s,
            "bytes_read": stats.prefill_bytes_read,
            "io_wait_s": stats.io_wait_s,
        }
    runtime.close()
    return {
        "load_s": load_s,
        "memory": runtime.footprint.to_dict() if getattr(runtime, "footprint", None) is not None else None,
        "prompts": prompts,
        "expert_cache_bytes": prompts[0]["expert_cache_bytes"],
        "working_set_bytes": prompts[0]["working_set_bytes"],
        "long_prefill": long_prefill,
        # the page cache's bytes read come from the kernel's count for this process (None: expert cache)
        "page_cache_reads_counted": getattr(runtime.cache, "reads_counted", None),
    }


def warm_every_expert(cache) -> None:
    """Read every expert of every layer into the cache (which must hold them all), as demand reads."""
    if cache.n_slots < len(cache.layout.experts):
        raise SystemExit(
            f"compute-only needs every expert resident: {len(cache.layout.experts)} slots, "
            f"the cache has {cache.n_slots}"
        )
    for layer, n in cache.layout.num_experts.items():
        fetch = cache.fetch_layer(layer, list(range(n)))
        for _ in fetch.missing:
            cache.wait(fetch)


def run_transformers(cfg: dict) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from weightstream.engine.generate import timed_generate

    hf_logging.disable_progress_bar()
    kwargs = {"dtype": "auto", "experts_implementation": "eager"}
    start = time.perf_counter()
    if cfg["mode"] == "accelerate":
        kwargs.update(device_map=accelerate_device_map(cfg["model_dir"]), offload_folder=cfg["offload_dir"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model_dir"], **kwargs)
    load_s = time.perf_counter() - start
    prompts = []
    for ids in cfg["prompts"]:
        new, prefill_s, decode_s, steps = timed_generate(model, torch.tensor([ids]), cfg["max_new_tokens"])
        prompts.append(
            {
                "token_ids": new,
                "prefill_s": prefill_s,
                "decode_s": decode_s,
                "decode_steps": steps,
                "decode_tokens_per_s": steps / decode_s if decode_s else 0.0,
            }
        )
    return {"load_s": load_s, "prompts": prompts}


def accelerate_device_map(model_dir: str) -> dict[str, str]:
    """Dense modules on the CPU, every experts module on disk: the same split weightstream makes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightstream.store.layout import experts_modules

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    experts = set(experts_modules(model))
    owners = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
    return {owner: ("disk" if owner in experts else "cpu") for owner in owners}


def main() -> None:
    cfg = json.load(sys.stdin)
    torch.set_num_threads(cfg.get("compute_threads") or torch.get_num_threads())
    runner = run_streaming if cfg["mode"] in ("expert-cache", "page-cache", "compute-only") else run_transformers
    result = runner(cfg)
    result.update(peak_rss_bytes=peak_rss(), pid=os.getpid(), compute_threads=torch.get_num_threads())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
