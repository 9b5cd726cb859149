"""One benchmark configuration, run in its own process (inside the memory cgroup): reads a JSON config on stdin,
prints one JSON result on stdout."""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def run_streaming(cfg: dict) -> dict:
    from weightstream.engine.generate import generate
    from weightstream.engine.loader import load_streaming_model

    start = time.perf_counter()
    model = load_streaming_model(cfg["model_dir"], expert_cache=cfg["expert_cache"], io_threads=cfg["io_threads"],
                                 chunk_bytes=cfg.get("chunk_bytes"), policy=cfg.get("policy", "lru"),
                                 expert_source="mmap" if cfg["mode"] == "page-cache" else "direct",
                                 predict_next=cfg.get("predict_next", False))
    load_s = time.perf_counter() - start
    runtime = model.weightstream
    if cfg.get("routing_trace"):
        from weightstream.engine.routing import RoutingReplay
        from weightstream.trace import load

        runtime.routing_override = RoutingReplay(load(cfg["routing_trace"]), runtime.layout)
    prompts = []
    for _ in range(cfg.get("passes", 1)):
        prompts = []
        for ids in cfg["prompts"]:
            new, stats = generate(model, torch.tensor([ids]), cfg["max_new_tokens"])
            prompts.append({"token_ids": new[0].tolist(), **{k: v for k, v in stats.to_dict().items()
                                                              if k != "layer_misses"}})
    runtime.close()
    return {"load_s": load_s, "prompts": prompts, "expert_cache_bytes": prompts[0]["expert_cache_bytes"],
            "working_set_bytes": prompts[0]["working_set_bytes"]}


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
        prompts.append({"token_ids": new, "prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps,
                        "decode_tokens_per_s": steps / decode_s if decode_s else 0.0})
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
    runner = run_streaming if cfg["mode"] in ("direct", "page-cache") else run_transformers
    result = runner(cfg)
    result.update(peak_rss_bytes=peak_rss(), pid=os.getpid(), compute_threads=torch.get_num_threads())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
