"""Build a transformers model whose experts stay on disk: dense weights in memory, experts through the cache."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from transformers import GenerationConfig

from weightstream import native
from weightstream.cache.expert_cache import ExpertCache
from weightstream.cache.sizes import DEFAULT_UPGRADE_AFTER, parse_cache_size
from weightstream.cache.warm import StateSaver, read_state, state_path
from weightstream.engine import EXPERT_SOURCES, SOURCE_ALIASES
from weightstream.engine import experts as ws_experts
from weightstream.engine.footprint import (
    Footprint,
    bound_heap,
    check_memory,
    release_heap,
    reset_peak,
    rss,
    settle_file_pages,
    size_cache,
)
from weightstream.engine.fused import fuse_dense_ops
from weightstream.engine.generate import generate
from weightstream.engine.kernels import (
    NativeLinear,
    QuantizedExperts,
    StoredEmbedding,
    check_kernel_name,
    choose_kernel,
)
from weightstream.engine.latent_attention import absorb_latent_attention, is_latent_attention
from weightstream.engine.latent_attention import check_form as check_latent_form
from weightstream.engine.page_cache_source import PageCacheSource
from weightstream.engine.predict import NextLayerPredictor
from weightstream.engine.runtime import ExpertsPart, StreamingRuntime
from weightstream.errors import WeightstreamError
from weightstream.io.pagecache import mapped_resident_bytes
from weightstream.store.convert import runnable_dir
from weightstream.store.facts import context_temporaries, is_lazy_dense, longest_context, ties_embeddings
from weightstream.store.facts import kv_cache_bytes as kv_cache_for
from weightstream.store.layout import experts_modules
from weightstream.store.model import map_model
from weightstream.store.quant_format import QuantFormat
from weightstream.units import parse_size

DEFAULT_CONTEXT = 4096  # tokens of KV cache `memory` reserves when the caller does not say


def load_streaming_model(
    model_dir: str,
    expert_cache: str | int | None = None,
    io_threads: int = 4,
    policy: str = "lru",
    chunk_bytes: int | None = None,
    o_direct: bool = True,
    policy_options: dict | None = None,
    expert_source: str = "expert-cache",
    predict_next: bool = False,
    expert_kernel: str = "auto",
    fuse: bool = True,
    memory: str | int | None = None,
    context: int | None = None,
    kv_cache_bytes: int | None = None,
    warmup_tokens: int = 32,
    warm_restart: bool = False,
    miss_copy: bool = False,
    upgrade_after: int | None = DEFAULT_UPGRADE_AFTER,
    latent_attention: str = "absorbed",
):
    """A transformers causal LM whose experts stream from `model_dir` through a fixed-budget cache.

    The cache is `expert_cache` ("1.5x" when neither it nor `memory` is given), or with `memory` (bytes or a size
    such as "1GiB") the largest that keeps the process within it: the engine loads with one token's experts,
    runs a `warmup_tokens`-token prompt and a decode step, measures its own footprint (engine/footprint.py),
    reserves the KV cache of `context` tokens (default 4096, at most the model's positions) or `kv_cache_bytes`
    (one sequence then reaches what it holds, at most `context`) and what a forward late in that context holds
    beyond the warm-up's, and gives the cache the rest; a `memory` that leaves less than one token's experts is
    refused with the size that would do. What the warm-up measured bounds a forward of at most `warmup_tokens`
    positions: a longer prompt is prefilled in chunks that long (`generate(prefill_chunk=...)`, serve's
    scheduler). `model.weightstream.footprint` holds the figures.
    `warm_restart=True` reads back the experts the cache held when this model last ran with it (saved under
    MODEL/.weightstream at exit and every minute), hottest first, in the background, within the budget.
    `miss_copy=True` (a checkpoint `quantize --miss-bits` wrote): a miss reads the expert's small copy (Q2_K / Q3_K)
    and computes with it; an expert looked up again while its small copy is resident is read in full precision
    into its slot before the layer computes with it (`upgrade_after`: at its N-th hit, default the eighth; None:
    never). Fewer bytes a miss, but tokens are not the model's exact ones.
    `expert_source="page-cache"` is the baseline instead: experts through mmap, no cache of our own.
    `predict_next=True` reads ahead each next MoE layer's experts as guessed by its router from this layer's input.
    `expert_kernel` "auto" takes the lean kernel proven bitwise equal to the architecture's eager forward, else
    "one-expert-eager" (that forward itself on a one-expert view); naming a kernel forces it (for comparisons).
    `fuse` (a model that computes in float32, its dense weights GGML blocks): RMSNorms and the rotary embedding run
    as one native op each where proven on the model's own code (engine/fused.py); False keeps transformers' ops.
    `latent_attention` (DeepSeek-V2/V3 and their kin): "absorbed" (default) attends over the cached latent, so a
    token's cost no longer grows with the context through kv_b_proj (engine/latent_attention.py; logits within
    rounding of transformers'); "expanded" keeps transformers' form, bitwise its logits.
    The returned model works with `.generate()`; `model.weightstream` is its StreamingRuntime (stats, hooks).
    """
    expert_source = _check_options(expert_kernel, expert_source, predict_next, miss_copy)
    check_latent_form(latent_attention)  # before anything loads
    memory_bytes = _check_memory(memory, expert_cache, expert_source, warm_restart)
    if memory_bytes is not None:
        bound_heap()  # so that what the warm-up measures is what decode holds
    libraries = rss()[0]  # the interpreter and every library imported so far: before any of the model
    ws_experts.register()
    # a published FP8 / MXFP4 checkpoint runs through a copy converted once beside it (the step says so on stderr)
    mapped = map_model(runnable_dir(model_dir), ws_experts.IMPLEMENTATION)
    model, layout = mapped.model, mapped.layout
    if miss_copy:
        _check_miss_copy(model_dir, mapped.quant)
    _load_dense(model, layout.dense, model_dir, mapped.quant)
    release_heap()  # what loading allocated and freed
    reset_peak()  # from here the peak is decode's (the load's own, before any cache, is lower than what follows)
    # before any I/O thread: a refusal leaves none running
    kernels = _kernels(model, expert_kernel, mapped.quant, miss_copy)
    computes_float32 = mapped.quant is not None and mapped.quant.compute_dtype is torch.float32
    fused = fuse_dense_ops(model) if fuse and computes_float32 else []
    has_latent = any(is_latent_attention(m) for m in model.modules())
    absorb_latent_attention(model, latent_attention)
    modules = experts_modules(model)
    parts = {module: _part(kernels[type(module)], layout.module_layers[path]) for path, module in modules.items()}
    tied = ties_embeddings(model.config)
    dense_touched = sum(t.nbytes for n, t in layout.dense.items() if not is_lazy_dense(n, tied))

    def cache_of(budget: int) -> ExpertCache:
        return ExpertCache(
            layout,
            budget,
            policy=policy,
            io_threads=io_threads,
            chunk_bytes=chunk_bytes,
            o_direct=o_direct,
            policy_options=policy_options,
            miss_copy=miss_copy,
            upgrade_after=upgrade_after,
        )

    def install(cache, footprint=None, saver=None) -> StreamingRuntime:
        runtime = StreamingRuntime(
            cache,
            layout,
            parts,
            kernels={cls.__name__: k.name for cls, k in kernels.items()},
            predictor=NextLayerPredictor(model, layout, cache.n_slots) if predict_next else None,
            fused=fused,
            dense_bytes_touched=dense_touched,
            footprint=footprint,
            state_saver=saver,
            miss_copy_bits=mapped.quant.miss_copy.bits if miss_copy else 0,
            latent_attention=latent_attention if has_latent else None,
            kv_cache_bytes_per_token=kv_cache_for(model.config.get_text_config(), 1, model.dtype.itemsize),
        )
        for module in modules.values():
            # transformers calls the registered experts forward with the module alone: this is its way to the runtime
            module._ws_runtime = runtime
        model.weightstream = runtime
        return runtime

    if os.path.exists(os.path.join(model_dir, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.eval()
    if expert_source == "page-cache":
        install(PageCacheSource(layout))
        return model
    footprint = None
    if memory_bytes is not None:
        text, itemsize, positions = model.config.get_text_config(), model.dtype.itemsize, _positions(model.config)
        kv = kv_cache_bytes
        if kv is None:
            context = context or min(DEFAULT_CONTEXT, positions)
            kv = kv_cache_for(text, context, itemsize)
        else:  # the longest context one sequence reaches in it (serve: --kv-cache, within --max-model-len)
            context = longest_context(text, kv, itemsize, min(context or positions, positions))
        eager = getattr(model.config, "_attn_implementation", None) == "eager"
        late = context_temporaries(text, context, warmup_tokens, itemsize, eager, latent_attention)
        runtime = install(cache_of(layout.working_set_bytes))
        footprint = _measure(model, runtime, memory_bytes, libraries, kv, context, warmup_tokens, late)
        budget = footprint.expert_cache
    else:
        budget = parse_cache_size(expert_cache if expert_cache is not None else "1.5x", layout.working_set_bytes)
    cache = cache_of(budget)
    try:
        saver = None
        if warm_restart:
            path = state_path(model_dir)
            state = read_state(path, layout)
            if state is not None:
                cache.warm(*state)
            saver = StateSaver(cache, path)
        install(cache, footprint, saver)
    except BaseException:
        cache.close()  # stops the I/O threads
        raise
    return model


def _check_memory(memory, expert_cache, expert_source: str, warm_restart: bool) -> int | None:
    """`memory` in bytes (None: not given), once it is shown to go with the other options and the machine."""
    if warm_restart and expert_source == "page-cache":
        raise WeightstreamError("--warm-restart restores the expert cache; --expert-source page-cache has none")
    if memory is None:
        return None
    if expert_cache is not None:
        raise WeightstreamError(
            f"--memory {memory} and --expert-cache {expert_cache}: give one; --memory sizes the expert cache itself"
        )
    if expert_source == "page-cache":
        raise WeightstreamError(
            "--memory sizes the expert cache, and --expert-source page-cache has none: run the page-cache path "
            "under a memory cgroup instead (`weightstream bench --memory-limit`)"
        )
    memory_bytes = parse_size(memory, what="--memory")
    check_memory(memory_bytes)
    return memory_bytes


def _positions(config) -> int:
    return int(getattr(config.get_text_config(), "max_position_embeddings", None) or DEFAULT_CONTEXT)


def _measure(
    model, runtime, memory: int, libraries: int, kv: int, context: int, warmup_tokens: int, late: int
) -> Footprint:
    """The footprint `memory` allows, from this process measured after load and a warm-up (a `warmup_tokens`
    prompt and one decode step through the 1x cache `runtime` serves from, which is then closed), with `kv` and what
    a forward late in the context holds more (`late`) reserved."""
    vocab = model.config.get_text_config().vocab_size
    prompt = (torch.arange(max(1, warmup_tokens)) * 7919 + 11).remainder(max(1, vocab - 10)).add(5)
    cache = runtime.cache
    try:
        generate(model, prompt[None, :], max_new_tokens=2)
        settle_file_pages()  # what decode touches is mapped by now; cold file pages go before they crowd it out
        peak = rss()[1]
        release_heap()  # the warm-up's temporaries: counted in `peak`, not held in between
        steady = rss()[0]
        cache_resident = mapped_resident_bytes(cache.arena.address, cache.arena.nbytes)
        table = model.get_input_embeddings().weight
        embedding = mapped_resident_bytes(table.data_ptr(), table.nbytes)
        return size_cache(
            memory,
            libraries,
            steady,
            peak,
            cache_resident,
            embedding,
            kv,
            context,
            warmup_tokens,
            runtime.layout.working_set_bytes,
            late,
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


def _check_options(expert_kernel: str, expert_source: str, predict_next: bool, miss_copy: bool = False) -> str:
    """The expert source's name (old names accepted); errors for options that cannot go together."""
    check_kernel_name(expert_kernel)
    expert_source = SOURCE_ALIASES.get(expert_source, expert_source)
    if expert_source not in EXPERT_SOURCES:
        raise WeightstreamError(f"--expert-source {expert_source!r}: choose one of {', '.join(EXPERT_SOURCES)}")
    if miss_copy and expert_source != "expert-cache":
        raise WeightstreamError(
            "--miss-copy reads small copies into the expert cache's slots and upgrades them there; --expert-source "
            "page-cache has no slots of our own (drop one of the two)"
        )
    if predict_next and expert_source != "expert-cache":
        raise WeightstreamError(
            "--predict-next needs --expert-source expert-cache: through the page cache there are "
            "no slots of our own to read ahead into"
        )
    return expert_source


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
    blocks = (quant.dense or {}) if quant is not None else {}
    for target in [t for t in state if dense[t].name in blocks]:
        if not native.available():
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
        path = target.removesuffix(".weight")
        parent, _, attr = path.rpartition(".")
        linear = model.get_submodule(path)
        wtype, (n, k) = blocks[dense[target].name]
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
            model.set_input_embeddings(StoredEmbedding(state.pop(name), embedding.padding_idx, param.dtype))
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
