"""What the steps between the products cost a decode token, paired token by token in one process.

Two comparisons on a checkpoint that computes in float32 (its dense weights GGML blocks, e.g. `weightstream
quantize MODEL --bits 4 --dense int4`), every expert resident:

1. `fused`: the native rms_norm and rope ops (engine/fused.py) against transformers' own RMSNorm modules and
   rotary function, switched in place before every token, alternating which goes first;
2. `kv`: the engine's KV cache (engine/kv_cache.py) against transformers' DynamicCache, two caches of the same
   generation advanced alternately, token by token, to --tokens positions past the prompt.

Pairing cancels this VM's drift (its speed moves by a third within minutes); each figure is the median over
tokens of one configuration's step time, and the median of the per-token differences. Also the dispatched torch
ops of one decode token with everything on (TorchDispatchMode: the calls Python makes, not their sub-ops), and the
floor: a decode step with the native products (`linear`, `moe_layer`) replaced by zeros of their shape, i.e. what
a token costs besides the weight arithmetic (transformers' modules, attention, the cache's bookkeeping, Python).

    .venv/bin/python benchmarks/kernel_bench.py steps .work/bench-models/olmoe-8l-q4k-d4 --tokens 400 \\
        --out benchmarks/results/decode-steps-olmoe8.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common.results import emit
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import DynamicCache

from weightstream.bench.child import warm_every_expert
from weightstream.bench.prompts import tokenized_prompts
from weightstream.engine.fused import use_native_ops
from weightstream.engine.kv_cache import engine_cache
from weightstream.engine.loader import load_streaming_model


def _step(model, token, cache, position):
    start = time.perf_counter()
    out = model(token, past_key_values=cache, use_cache=True, cache_position=torch.tensor([position]))
    return out.logits[:, -1:].argmax(-1), time.perf_counter() - start


def _summary(times: dict, diffs: list[float]) -> dict:
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    return {"median_ms": ms, "paired_saving_median_ms": 1000 * statistics.median(diffs), "tokens": len(diffs)}


def fused_pair(model, prompt, tokens: int) -> dict:
    """Native norms and rotary against transformers', switched before each token of one generation."""
    if not use_native_ops(model, True):
        raise SystemExit("the model has no fused ops: give a checkpoint whose dense weights are GGML blocks")
    times, diffs = {"native": [], "transformers": []}, []
    try:
        cache = engine_cache(model, prompt.shape[1] + tokens + 1)
        token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for i in range(tokens):
            native = i % 2 == 0
            use_native_ops(model, native)
            token, dt = _step(model, token, cache, prompt.shape[1] + i)
            times["native" if native else "transformers"].append(dt)
        diffs = [b - a for a, b in zip(times["native"], times["transformers"], strict=False)]
    finally:
        use_native_ops(model, True)
    return _summary(times, diffs)


def kv_pair(model, prompt, tokens: int) -> dict:
    """The engine's cache against DynamicCache: two generations advanced alternately, token by token."""
    caches = {"engine": engine_cache(model, prompt.shape[1] + tokens + 1), "dynamic": DynamicCache(config=model.config)}
    next_token = {}
    for name, cache in caches.items():
        next_token[name] = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    times, diffs, same = {name: [] for name in caches}, [], True
    for i in range(tokens):
        step = {}
        for name in ("engine", "dynamic") if i % 2 else ("dynamic", "engine"):
            next_token[name], step[name] = _step(model, next_token[name], caches[name], prompt.shape[1] + i)
            times[name].append(step[name])
        same = same and torch.equal(next_token["engine"], next_token["dynamic"])
        diffs.append(step["dynamic"] - step["engine"])
    out = _summary(times, diffs)
    half = len(diffs) // 2
    out["paired_saving_median_ms_second_half"] = 1000 * statistics.median(diffs[half:])
    out["positions"] = [prompt.shape[1], prompt.shape[1] + tokens]
    out["same_tokens"] = same
    return out


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(model, prompt, tokens: int = 4) -> float:
    cache = engine_cache(model, prompt.shape[1] + tokens + 1)
    token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    with _Count() as count:
        for i in range(tokens):
            token, _ = _step(model, token, cache, prompt.shape[1] + i)
    return count.calls / tokens


def floor(model, prompt, tokens: int) -> dict:
    """Step times with the products answered by zeros (the weights never read), against the real ones, paired."""
    from weightstream import native

    real = native.linear, native.moe_layer, native.heads_product

    def use(fake: bool) -> None:
        if fake:
            native.linear = lambda x, w, wtype, n, k, bias: x.new_zeros(*x.shape[:-1], n)
            native.moe_layer = lambda x, *args, into=None, **kw: None if into is not None else torch.zeros_like(x)
            native.heads_product = lambda x, w, wtype, n: x.new_zeros(*x.shape[:-1], n)  # latent attention's k_b, v_b
        else:
            native.linear, native.moe_layer, native.heads_product = real

    times = {"products": [], "zeros": []}
    try:
        cache = engine_cache(model, prompt.shape[1] + tokens + 1)
        token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for i in range(tokens):
            use(i % 2 == 1)
            token, dt = _step(model, token, cache, prompt.shape[1] + i)
            times["zeros" if i % 2 else "products"].append(dt)
    finally:
        use(False)
    return {"median_ms": {name: 1000 * statistics.median(t) for name, t in times.items()}, "tokens": tokens}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint whose dense weights are GGML blocks (quantize --dense int4|int8)")
    ap.add_argument("--tokens", type=int, default=400, help="decode tokens of each paired run (default 400)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    model = load_streaming_model(args.model, expert_cache="1000x")
    try:
        warm_every_expert(model.weightstream.cache)
        prompt = torch.tensor([tokenized_prompts(args.model, None)[0]])
        with torch.inference_mode():
            report = {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "model": args.model,
                "threads": torch.get_num_threads(),
                "fused": model.weightstream.fused,
                "dispatched_ops_per_token": dispatched_ops(model, prompt),
                "floor_without_products": floor(model, prompt, 64),
                "fused_vs_transformers": fused_pair(model, prompt, args.tokens),
                "engine_kv_vs_dynamic_cache": kv_pair(model, prompt, args.tokens),
            }
    finally:
        model.weightstream.close()
    emit(report, args.out)
