"""Build a transformers model whose experts stay on disk: dense weights in memory, experts through the cache."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from transformers import GenerationConfig

from weightstream import native
from weightstream.cache.expert_cache import ExpertCache
from weightstream.cache.sizes import parse_cache_size
from weightstream.cache.warm import StateSaver, read_state, state_path
from weightstream.engine import experts as ws_experts
from weightstream.engine.config import EngineConfig
from weightstream.engine.file_guard import guard_model
from weightstream.engine.footprint import (
    Footprint,
    bound_heap,
    check_memory,
    release_heap,
    reset_peak,
    rss,
    settle_file_pages,
    size_cache,
    tensor_bytes,
)
from weightstream.engine.fused import fuse_dense_ops
from weightstream.engine.generate import generate
from weightstream.engine.grouped_attention import install_grouped_attention
from weightstream.engine.kernels.choice import choose_kernel
from weightstream.engine.kernels.dense import NativeLinear, StoredEmbedding, lookup_without_padding
from weightstream.engine.kernels.quantized import QuantizedExperts
from weightstream.engine.kv_cache import dtype_name, kv_storage, store_kv_in, value_bytes
from weightstream.engine.latent_attention import absorb_latent_attention, is_latent_attention, keep_kv_b_apart
from weightstream.engine.lean_layer import install_lean_layers
from weightstream.engine.lean_moe import install_lean_moe
from weightstream.engine.page_cache_source import PageCacheSource
from weightstream.engine.predict import NextLayerPredictor
from weightstream.engine.runtime import ExpertsPart, StreamingRuntime
from weightstream.engine.sink_attention import EAGER_BELOW, install_sink_attention, sinks_run_flash
from weightstream.errors import WeightstreamError
from weightstream.io.pagecache import mapped_resident_bytes
from weightstream.store.convert import runnable_dir
from weightstream.store.facts import (
    context_temporaries,
    is_lazy_dense,
    longest_context,
    smaller_latent_kv,
    ties_embeddings,
)
from weightstream.store.facts import kv_cache_bytes as kv_cache_for
from weightstream.store.layout import experts_modules
from weightstream.store.model import map_model
from weightstream.store.quant.manifest import QuantFormat

DEFAULT_CONTEXT = 4096  # tokens of KV cache `memory` reserves when the caller does not say


def load_streaming_model(model_dir: str, config: EngineConfig | None = None, **options):
    """A transformers causal LM whose experts stream from `model_dir` through a fixed-budget cache, run as `config`
    says (engine/config.py: every option, checked before anything loads); keyword `options` are EngineConfig's
    fields, over `config` where both are given.

    With `memory` the engine loads with one token's experts, runs a `warmup_tokens`-token prompt and a decode step,
    measures its own footprint (engine/footprint.py), reserves the KV cache of `context` tokens or `kv_cache_bytes`
    and what a forward late in that context holds beyond the warm-up's, and gives the cache the rest; a `memory` that
    leaves less than one token's experts is refused with the size that would do. What the warm-up measured bounds a
    forward of at most `warmup_tokens` positions: a longer prompt is prefilled in chunks that long
    (`generate(prefill_chunk=...)`, serve's scheduler). `model.weightstream.footprint` holds the figures.
    A published FP8 / MXFP4 checkpoint runs through a copy converted once beside it (store/convert.py, said on
    stderr). The returned model works with `.generate()`; `model.weightstream` is its StreamingRuntime (stats,
    hooks, `config`).
    """
    config = config.replace(**options) if config is not None else EngineConfig(**options)
    memory_bytes = config.memory_bytes
    if memory_bytes is not None:
        check_memory(memory_bytes)  # against this machine
        bound_heap()  # so that what the warm-up measures is what decode holds
    libraries = rss()[0]  # the interpreter and every library imported so far: before any of the model
    built = _build(model_dir, config)
    model, layout = built.model, built.layout
    # a weight file written or truncated under the model: an error naming it, not a SIGBUS (engine/file_guard.py)
    model._ws_file_guard = guard = guard_model(model, _weight_files(layout))
    try:
        _serve_from_cache(built, config, model_dir, libraries)
    except BaseException:
        guard.close()  # the leases go with a model that did not load
        raise
    return model


@dataclass(slots=True)
class _Built:
    """What the loader's steps share: the model with its dense weights, and how its experts will be computed."""

    model: torch.nn.Module
    layout: object  # store.layout.ModelLayout
    quant: QuantFormat | None
    kernels: dict[type, object]
    parts: dict
    fused: list
    latent: bool  # the model has DeepSeek's latent attention
    dense_touched: int


def _serve_from_cache(built: _Built, config: EngineConfig, model_dir: str, libraries: int) -> None:
    """Generation config, eval mode, and the expert source: the page cache, or an expert cache sized as `config`
    says (measured with `memory`), warm-restarted where asked; the runtime installed over it."""
    model, layout = built.model, built.layout
    memory_bytes = config.memory_bytes
    if os.path.exists(os.path.join(model_dir, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.eval()
    if config.expert_source == "page-cache":
        _install(built, config, PageCacheSource(layout))
        return
    footprint = None
    if memory_bytes is not None:
        footprint = _measure(built, config, memory_bytes, libraries)
        budget = footprint.expert_cache
    else:
        budget = parse_cache_size(
            config.expert_cache if config.expert_cache is not None else "1.5x", layout.working_set_bytes
        )
    cache = _cache(layout, config, budget)
    try:
        saver = None
        if config.warm_restart:
            path = state_path(model_dir)
            state = read_state(path, layout)
            if state is not None:
                cache.warm(*state)
            saver = StateSaver(cache, path)
        _install(built, config, cache, footprint, saver)
    except BaseException:
        cache.close()  # stops the I/O threads
        raise


def _build(model_dir: str, config: EngineConfig) -> _Built:
    """Map the checkpoint, load its dense weights, choose the expert kernels, fuse and absorb what the config asks."""
    ws_experts.register()
    # a published FP8 / MXFP4 checkpoint runs through a copy converted once beside it (the step says so on stderr)
    mapped = map_model(runnable_dir(model_dir), ws_experts.IMPLEMENTATION)
    model, layout, quant = mapped.model, mapped.layout, mapped.quant
    if config.miss_copy:
        _check_miss_copy(model_dir, quant)
    _load_dense(model, layout.dense, model_dir, quant)
    lookup_without_padding(model.get_input_embeddings())
    release_heap()  # what loading allocated and freed
    reset_peak()  # from here the peak is decode's (the load's own, before any cache, is lower than what follows)
    # before any I/O thread: a refusal leaves none running
    kernels = _kernels(model, config.expert_kernel, quant, config.miss_copy)
    computes_float32 = quant is not None and quant.compute_dtype is torch.float32
    fused = fuse_dense_ops(model) + install_lean_moe(model) if config.fuse and computes_float32 else []
    latent = any(is_latent_attention(m) for m in model.modules())
    absorb_latent_attention(model, config.latent_attention)
    store_kv_in(model, config.kv_dtype, latent, config.latent_attention, model_dir)
    if config.fuse and computes_float32:  # after absorbing: its one-row call is the absorbed attention's
        fused += install_lean_layers(model)
    install_sink_attention(model)  # gpt-oss: long prompts without eager's score matrices
    install_grouped_attention(model)  # fewer key heads than query heads: no repeated keys over a long cache
    modules = experts_modules(model)
    parts = {module: _part(kernels[type(module)], layout.module_layers[path]) for path, module in modules.items()}
    tied = ties_embeddings(model.config)
    touched = sum(t.nbytes for n, t in layout.dense.items() if not is_lazy_dense(n, tied))
    return _Built(model, layout, quant, kernels, parts, fused, latent, touched)


def _smaller_kv(built: _Built, config: EngineConfig, kv_bytes: float) -> str:
    """--memory's refusal: a latent cache could be kept in fewer bytes (float16, q8_0)."""
    if built.latent and config.latent_attention == "absorbed":
        return smaller_latent_kv(built.model.config.get_text_config(), kv_bytes, native.has("quantize_q8_0"))
    return ""


def kv_itemsize(model) -> float:
    """Bytes of one cached value: the cache's storage (q8_0: 34 bytes a 32 values), else the model's dtype."""
    return value_bytes(kv_storage(model) or model.dtype)


def _weight_files(layout) -> set[str]:
    """Every file the model's weights are read from: its dense tensors' and its experts' (blobs, small copies)."""
    files = {info.path for info in layout.dense.values()}
    return files | {piece.path for expert in layout.experts.values() for piece in expert.pieces}


def _cache(layout, config: EngineConfig, budget: int) -> ExpertCache:
    return ExpertCache(
        layout,
        budget,
        policy=config.policy,
        io_threads=config.io_threads,
        chunk_bytes=config.chunk_bytes,
        o_direct=config.o_direct,
        policy_options=config.policy_options,
        miss_copy=config.miss_copy,
        upgrade_after=config.upgrade_after,
    )


def _install(built: _Built, config: EngineConfig, cache, footprint=None, saver=None) -> StreamingRuntime:
    """The runtime over `cache`, put where transformers' experts forward and the caller find it."""
    model = built.model
    runtime = StreamingRuntime(
        cache,
        built.layout,
        built.parts,
        kernels={cls.__name__: k.name for cls, k in built.kernels.items()},
        predictor=NextLayerPredictor(model, built.layout, cache.n_slots) if config.predict_next else None,
        fused=built.fused,
        dense_bytes_touched=built.dense_touched,
        footprint=footprint,
        state_saver=saver,
        miss_copy_bits=built.quant.miss_copy.bits if config.miss_copy else 0,
        latent_attention=config.latent_attention if built.latent else None,
        kv_cache_bytes_per_token=kv_cache_for(model.config.get_text_config(), 1, kv_itemsize(model)),
        kv_dtype=dtype_name(kv_storage(model) or model.dtype),
        config=config,
        file_guard=getattr(model, "_ws_file_guard", None),
    )
    for module in experts_modules(model).values():
        # transformers calls the registered experts forward with the module alone: this is its way to the runtime
        module._ws_runtime = runtime
    model.weightstream = runtime
    return runtime


def _positions(config) -> int:
    return int(getattr(config.get_text_config(), "max_position_embeddings", None) or DEFAULT_CONTEXT)


def _measure(built: _Built, config: EngineConfig, memory: int, libraries: int) -> Footprint:
    """The footprint `memory` allows, from this process measured after load and a warm-up (a `warmup_tokens` prompt
    and one decode step through a 1x cache, closed after), with the KV cache and what a forward late in the context
    holds more reserved."""
    model, layout = built.model, built.layout
    text, itemsize, positions = model.config.get_text_config(), model.dtype.itemsize, _positions(model.config)
    kv, context, kv_bytes = config.kv_cache_bytes, config.context, kv_itemsize(model)
    if kv is None:
        context = context or min(DEFAULT_CONTEXT, positions)
        kv = kv_cache_for(text, context, kv_bytes)
    else:  # the longest context one sequence reaches in it (serve: --kv-cache, within --max-model-len)
        context = longest_context(text, kv, kv_bytes, min(context or positions, positions))
    eager = getattr(model.config, "_attn_implementation", None) == "eager"
    # gpt-oss's sink attention, a late chunk's matrix as large as EAGER_BELOW: flash, no score matrix
    flash = eager and sinks_run_flash(model, config.warmup_tokens, context)
    late = context_temporaries(
        text,
        context,
        config.warmup_tokens,
        max(itemsize, kv_bytes),
        eager and not flash,
        config.latent_attention,
        EAGER_BELOW if flash else 0,
    )
    cache = _install(built, config, _cache(layout, config, layout.working_set_bytes)).cache
    vocab = text.vocab_size
    prompt = (torch.arange(config.warmup_tokens) * 7919 + 11).remainder(max(1, vocab - 10)).add(5)
    try:
        generate(model, prompt[None, :], max_new_tokens=2)
        settle_file_pages()  # what decode touches is mapped by now; cold file pages go before they crowd it out
        peak = rss()[1]
        release_heap()  # the warm-up's temporaries: counted in `peak`, not held in between
        steady = rss()[0]
        cache_resident = mapped_resident_bytes(cache.arena.address, cache.arena.nbytes)
        table = model.get_input_embeddings().weight
        embedding = mapped_resident_bytes(table.data_ptr(), table.nbytes)
        # what the dense tensors span, the input embedding as its touched rows (all of it where the head reads it)
        tied = ties_embeddings(model.config)
        tensors = [*model.parameters(), *model.buffers()]
        held = tensor_bytes(tensors, None if tied else table) + (0 if tied else embedding)
        return size_cache(
            memory,
            libraries,
            steady,
            peak,
            cache_resident,
            embedding,
            kv,
            context,
            config.warmup_tokens,
            layout.working_set_bytes,
            late,
            _smaller_kv(built, config, kv_bytes),
            held,
        )
    finally:
        cache.close()
        cache.arena.release()  # its slots go back to the kernel before the sized cache takes its own


def read_layout(model_dir: str):
    """(transformers config, ModelLayout) of a checkpoint without loading any weight: a meta model and its index."""
    mapped = map_model(model_dir)
    return mapped.config, mapped.layout


def read_pinned_experts(path: str) -> list[tuple[int, int]]:
    """The (layer, expert) keys of a pinned-experts file: {"pinned_experts": [[layer, expert], ...]}."""
    try:
        with open(path) as f:
            data = json.load(f)
        keys = [(int(layer), int(expert)) for layer, expert in data["pinned_experts"]]
    except OSError as exc:
        raise WeightstreamError(f"--pinned-experts {path}: cannot read it ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError):
        raise WeightstreamError(
            f'--pinned-experts {path}: expected {{"pinned_experts": [[layer, expert], ...]}} (as `weightstream '
            "tune` writes it)"
        ) from None
    return keys


def _check_miss_copy(model_dir: str, quant: QuantFormat | None) -> None:
    """--miss-copy needs the small copies `quantize --miss-bits` writes."""
    if quant is None or quant.miss_copy is None:
        what = "a quantized checkpoint without small copies" if quant is not None else "not a quantized checkpoint"
        raise WeightstreamError(
            f"--miss-copy: {model_dir} is {what}, so a miss has no small copy to read; write them with "
            "`weightstream quantize SRC --bits 4 --miss-bits 2 --out DIR` (SRC: the original checkpoint) and run DIR"
        )


def _part(kernel, layer: int) -> ExpertsPart:
    """An experts module's layer and kernel (a copy for the layer where its block types are the layer's own)."""
    return ExpertsPart(layer, kernel.for_layer(layer) if isinstance(kernel, QuantizedExperts) else kernel)


def _kernels(model, expert_kernel: str, quant: QuantFormat | None, miss_copy: bool = False) -> dict[type, object]:
    """One kernel per experts class (proving one costs one expert's worth of random weights)."""
    kernels = {}
    for module in experts_modules(model).values():
        if type(module) not in kernels:
            kernels[type(module)] = choose_kernel(module, expert_kernel, quant, miss_copy)
    return kernels


def _load_dense(model, dense: dict, model_dir: str, quant: QuantFormat | None = None) -> None:
    """Load every non-expert tensor into memory, tie weights, and compute buffers the checkpoint lacks; dense
    weights stored as GGML blocks (`quantize --dense`) become NativeLinear modules."""
    state = {}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for target, info in dense.items():
        by_file.setdefault(info.path, []).append((target, info.name))
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as f:
            for target, name in keys:
                state[target] = f.get_tensor(name)
    listed = (quant.dense or {}) if quant is not None else {}
    blocks = {t: listed[dense[t].name] for t in state if dense[t].name in listed}  # target -> (type, (n, k))
    if blocks and not native.available():
        gguf = (quant.source or {}).get("gguf")
        hint = (
            f"`weightstream import` keeps {gguf}'s blocks as they are (experts and dense linear weights alike), "
            "so the directory runs only where the native kernels do: importing again would not change that"
            if gguf
            else "or quantize the original checkpoint with --dense keep"
        )
        raise WeightstreamError(
            f"{model_dir}: its dense weights are GGML blocks, which need weightstream's native kernels "
            f"({native.why_not()}); {hint}"
        )
    keep_kv_b_apart(model, state, blocks, model_dir)  # DeepSeek's k_b and v_b: no Linear of transformers' own
    for target in [t for t in blocks if t in state]:
        path = target.removesuffix(".weight")
        parent, _, attr = path.rpartition(".")
        linear = model.get_submodule(path)
        wtype, (n, k) = blocks[target]
        setattr(model.get_submodule(parent), attr, NativeLinear(state.pop(target), wtype, n, k, linear.bias))
    _to_compute_dtype(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    _init_buffers(model)
    expert_params = {
        f"{p}.{n}" for p, m in experts_modules(model).items() for n, _ in m.named_parameters(recurse=False)
    }
    missing = [n for n, p in model.named_parameters() if p.is_meta and n not in expert_params]
    if missing:
        raise WeightstreamError(
            f"{model_dir}: checkpoint lacks dense tensor(s) {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; the files do not match config.json"
        )


def _to_compute_dtype(model, state: dict) -> None:
    """Float tensors stored in another dtype than the model computes in (a quantized-dense checkpoint computes in
    float32: `QuantFormat.compute_dtype`) are converted, but an untied input embedding: it is read one row a token,
    so it stays as stored (StoredEmbedding) and its rows are converted as they are looked up."""
    params = dict(model.named_parameters())
    embedding = model.get_input_embeddings()
    tied = ties_embeddings(model.config)
    for name, tensor in list(state.items()):
        param = params.get(name)
        if param is None or not tensor.is_floating_point() or tensor.dtype == param.dtype:
            continue
        if param is embedding.weight and not tied:
            model.set_input_embeddings(StoredEmbedding(state.pop(name), param.dtype))
            continue
        state[name] = tensor.to(param.dtype)


def _init_buffers(model) -> None:
    """Non-persistent buffers (rotary frequencies) are computed by the model's own initialiser, as transformers does."""
    owners = set()
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            owner._buffers[attr] = torch.empty_like(buf, device="cpu")
            owners.add(owner)
    for tensor in list(model.parameters()) + list(model.buffers()):
        tensor._is_hf_initialized = True
    for module in model.modules():
        module._is_hf_initialized = module not in owners
    for owner in owners:
        for buf in owner.buffers(recurse=False):
            buf._is_hf_initialized = False
    model.initialize_weights()
    still = [n for n, b in model.named_buffers() if b.is_meta]
    if still:
        raise WeightstreamError(f"buffers {still} could not be initialised for {model.config.model_type}")


def load_tokenizer(model_dir: str, required: bool):
    """The checkpoint's tokenizer, or None when it has none and none is needed."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as exc:
        if required:
            raise WeightstreamError(
                f"{model_dir}: no usable tokenizer ({exc}); pass --prompt-ids instead of --prompt"
            ) from exc
        return None
