"""`weightstream tune`'s session on one model: budget, routing, cost model, search and answer (tune/report.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING

from weightstream.bench.calibration_store import HISTORY, calibration_key, load_saved, save, store_path
from weightstream.bench.machine import read_ahead_bytes
from weightstream.errors import WeightstreamError
from weightstream.sim.budget import checkpoint_budget
from weightstream.sim.cost_model import CostModel
from weightstream.sim.tune import model_facts
from weightstream.store.convert import runnable_dir
from weightstream.store.facts import ties_embeddings
from weightstream.store.model import map_model
from weightstream.tune.report import Cost, build_report

if TYPE_CHECKING:
    pass


BUILTIN_NOTE = (
    "recorded on the built-in prompts: real prompts (--prompts FILE) or a trace of your workload give a better answer"
)


def say(msg: str) -> None:
    print(f"[tune] {msg}", file=sys.stderr, flush=True)  # stderr: --json keeps stdout to one object


def kv_value_bytes(mapped, kv_dtype: str, model_dir: str) -> float | None:
    """Bytes a cached value takes under `--kv-dtype` (None: the model's dtype; q8_0 34 bytes a 32 values), refused as
    the engine refuses it."""
    from weightstream.engine.kv_cache import Q8_0, check_q8_0, kv_dtype_for, value_bytes

    text = mapped.config.get_text_config()
    storage = kv_dtype_for(kv_dtype, bool(getattr(text, "kv_lora_rank", None)), model_dir, mapped.config.model_type)
    if storage is Q8_0:
        check_q8_0(text, f"--kv-dtype q8_0: {model_dir} ({mapped.config.model_type})")
    return None if storage is None else value_bytes(storage)


class TuneSession:
    """One model, one memory limit; loads the engine only when routing must be recorded or the machine measured."""

    def __init__(self, model_dir: str, memory_bytes: int, context: int, io_threads: int, kv_dtype: str = "auto"):
        if not os.path.isdir(model_dir):
            raise WeightstreamError(f"{model_dir}: not a model directory (config.json + *.safetensors)")
        self.model_dir, self.io_threads = model_dir, io_threads
        mapped = map_model(runnable_dir(model_dir))  # a published FP8 / MXFP4 checkpoint: converted once, saying so
        self.config, self.layout, self.ckpt = mapped.config, mapped.layout, mapped.ckpt
        self.quant = mapped.quant  # small copies (`quantize --miss-bits`): tune prices `--miss-copy` too
        first_file = next(iter(self.layout.experts.values())).pieces[0].path
        self.facts = model_facts(self.layout, ties_embeddings(self.config), read_ahead_bytes(first_file))
        self.kv_dtype = kv_dtype
        self.budget = checkpoint_budget(mapped, memory_bytes, context, kv_value_bytes(mapped, kv_dtype, model_dir))
        self.store = store_path(model_dir)
        self.model = None
        self.timings: dict[str, float] = {}

    def engine(self, cache_bytes: int | None = None):
        """The streaming model, loaded once; its cache defaults to the whole budget (what the user can afford)."""
        if self.model is None:
            from weightstream.engine.loader import load_streaming_model

            say("loading the engine")
            cache = cache_bytes or min(self.budget.expert_bytes, len(self.layout.experts) * self.layout.slot_bytes)
            self.model = load_streaming_model(
                self.model_dir, expert_cache=cache, io_threads=self.io_threads, kv_dtype=self.kv_dtype
            )
        return self.model

    def routing(self, trace_path: str | None, prompts_path: str | None, max_new_tokens: int):
        """(routing trace in this model's shape, what it is) from a trace file, or recorded on prompts."""
        from weightstream.engine.routing import layout_shape
        from weightstream.trace import load
        from weightstream.trace.remap import onto_shape

        start = time.perf_counter()
        shape = layout_shape(self.layout, self.config.model_type)
        if trace_path:
            source = load(trace_path)
            trace = onto_shape(source, shape)
            info = {"source": "trace", "file": trace_path, "trace_shape": source.shape.name}
            if source.shape.to_dict() != {**shape.to_dict(), "name": source.shape.name}:
                info["replayed"] = (
                    f"{source.shape.name} routing replayed on this model as `bench --routing-trace` does: model "
                    f"layer i takes trace layer i mod {len(source.shape.layers)}, top-{source.shape.top_k} of the trace"
                )
        else:
            trace, info = self._record(prompts_path, max_new_tokens)
        info.update(requests=len(trace.requests), tokens=trace.n_tokens, steps=trace.n_steps)
        self.timings["routing_s"] = time.perf_counter() - start
        return trace, info

    def _record(self, prompts_path: str | None, max_new_tokens: int):
        from weightstream.bench.prompts import BUILTIN_PROMPTS, read_prompts
        from weightstream.engine.loader import load_tokenizer
        from weightstream.engine.routing import record_routing
        from weightstream.trace import save as save_trace

        prompts = read_prompts(prompts_path) if prompts_path else list(BUILTIN_PROMPTS)
        tokenizer = load_tokenizer(self.model_dir, required=True)
        model = self.engine()
        say(f"recording routing: {len(prompts)} prompt(s) x {max_new_tokens} tokens")
        trace = record_routing(model, tokenizer, prompts, max_new_tokens, self.config.model_type)
        info = {"source": "recorded", "prompts": prompts_path or "built-in", "max_new_tokens": max_new_tokens}
        if not prompts_path:
            info["note"] = BUILTIN_NOTE
        try:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            save_trace(trace, self.store.parent / "routing-recorded.npz")
            info["saved_to"] = str(self.store.parent / "routing-recorded.npz")
        except OSError:
            pass
        return trace, info

    def cost(
        self, calibrate: bool, linear: CostModel | None = None, linear_path: str | None = None, forget: bool = False
    ) -> Cost:
        """What prices the configurations; `linear`: bench's line read from `linear_path`
        (`calibration_store.read_cost_model`). Calibrations add up: the params are the median of this machine's
        last `calibration_store.HISTORY` (only the new one with `forget`)."""
        from weightstream.sim.overlap_model import CostParams

        start = time.perf_counter()
        key = calibration_key(self.ckpt, self.io_threads, None)
        saved = None if calibrate else load_saved(self.store, key)
        if linear is not None:
            params = CostParams.from_dict(saved["params"]) if saved else None
            info = {"source": f"bench cost model {linear_path}", "linear": linear.to_dict()}
            if params is None:
                info["page_cache"] = "not predicted: no saved calibration (run tune --calibrate once)"
            return Cost(params, linear, info)
        if saved:
            info = {"source": f"saved {self.store}", "created": saved["created"], **_combined(saved)}
            return Cost(CostParams.from_dict(saved["params"]), None, info)
        params, info = self._calibrate(key, keep=1 if forget else HISTORY)
        self.timings["calibration_s"] = time.perf_counter() - start
        return Cost(params, None, info)

    def _calibrate(self, key: dict, keep: int):
        from weightstream.bench.calibrate import Calibrator
        from weightstream.sim.overlap_model import CostParams, fit_cost_params

        say("calibrating this machine (once per model and setting; --calibrate measures again)")
        model = self.engine(self.layout.working_set_bytes)  # calibration brings its own caches
        calibration = Calibrator(model, self.io_threads, None, progress=say).run()
        self.close()  # nothing after this runs the engine: its memory goes back before the search
        measurements = calibration.measurements
        params = fit_cost_params(measurements)
        info = {"source": "measured now", "measured_params": params.to_dict(), "measurements": measurements.to_dict()}
        combined = None
        try:
            save(self.store, key, params, measurements.to_dict(), calibration.extra(), keep=keep)
            info["saved_to"] = str(self.store)
            combined = load_saved(self.store, key)
        except OSError as exc:
            info["not_saved"] = f"{self.store}: {exc.strerror}"
        if combined is None:  # not saved, or not read back (the file replaced meanwhile): this measurement alone
            return params, {**info, "params": params.to_dict(), "samples": 1}
        if combined["samples"] > 1:
            say(f"pricing with the median of this machine's last {combined['samples']} calibrations")
        return CostParams.from_dict(combined["params"]), {**info, **_combined(combined)}

    def answer(
        self, trace, routing: dict, cost: Cost, policies: list[str], max_new_tokens: int, gpu_memory_bytes: int | None
    ) -> dict:
        start = time.perf_counter()
        report = build_report(self, trace, routing, cost, policies, max_new_tokens, gpu_memory_bytes)
        report["timings_s"] = {**self.timings, "search_s": time.perf_counter() - start}
        return report

    def write_pinned(self, keys: list[tuple[int, int]], slots: int) -> str:
        """Save a pinned set for `generate --pinned-experts` next to the calibration; returns its path."""
        path = self.store.parent / f"pinned-{slots}-slots.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"pinned_experts": [list(k) for k in keys], "slots": slots}))
        return str(path)

    def close(self) -> None:
        if self.model is not None:
            self.model.weightstream.close()
            self.model = None


def _combined(saved: dict) -> dict:
    """What the report says of the calibrations it priced with: their median params, how many, how far apart."""
    return {
        "params": saved["params"],
        "samples": saved["samples"],
        "spread": saved["spread"],
        "created_each": [e.get("created") for e in saved["entries"]],
    }
