"""The engine's KV cache: transformers' DynamicCache whose full-attention layers write each step into buffers
sized for the whole generation, instead of concatenating.

transformers' DynamicLayer grows its keys and values by `torch.cat` at every step, so a decode token copies the
whole cache: O(context) bytes a token (on the 8-layer OLMoE shape in float32, 8.8 MB a token at 70 positions,
0.6 ms of a 20 ms token; 67 MB at 512). `GrowingLayer` allocates its buffers once, for the prompt and every new
token (`engine_cache(model, tokens)`), writes each step's keys and values in place and returns views of the filled
positions, so attention still sees exactly the cached positions (scaled_dot_product_attention gives the same bits
on these views as on contiguous copies: tests/test_engine_exact.py compares the engine with transformers'
in-memory model token for token and logit for logit). Past the hint, or after transformers reassigns `keys`
(crop, beam reordering), the layer re-allocates from what it holds. Sliding-window layers stay transformers'.
A model whose transformers class builds a cache of its own (MiniMax) raises on any other, so it gets none from here.

A layer may store in a dtype of its own (`kv_dtype`): DeepSeek's latent cache in float16 or bfloat16 (EngineConfig
`kv_dtype`, `--kv-dtype`), half a float32 cache's bytes as llama.cpp's default f16 cache, or in q8_0 (llama.cpp's
`-ctk q8_0`: each 32 values a float16 scale and 32 int8 codes, 34 bytes; uint8 rows of whole blocks, `Q8_0`); each
update is rounded to it as it is written, and the views handed back are of that dtype (engine/latent_attention.py
reads them; `widened` gives a q8_0 view's float32 values).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from weightstream import native
from weightstream.errors import WeightstreamError
from weightstream.store.facts import q8_0_odd_dims


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers for `capacity` positions, of `storage` dtype (None:
    the states' own)."""

    def __init__(self, capacity: int, storage: torch.dtype | None = None):
        super().__init__()
        self.capacity = max(1, capacity)
        self.storage = storage
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.storage is not None:
            self.keys, self.values = self.keys.to(self.storage), self.values.to(self.storage)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.storage is Q8_0:
            key_states, value_states = stored(key_states, Q8_0), stored(value_states, Q8_0)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used, new = self.get_seq_length(), key_states.shape[-2]
        if not self._fits(used + new, key_states, value_states):
            self._reallocate(used, used + new, key_states, value_states)
        self._key_buffer[:, :, used : used + new].copy_(key_states)
        self._value_buffer[:, :, used : used + new].copy_(value_states)
        self.filled(used + new)
        return self.keys, self.values

    def reserve_row(self) -> int | None:
        """For a writer that fills the next position of the buffers itself (a native decode row, engine/lean_layer.py):
        room for one more position, and its index; None where the layer holds nothing yet (its first update sets the
        shapes) or its keys are not 4-d. `filled` then makes the views include it."""
        if not self.is_initialized or self.keys.dim() != 4 or not self.keys.numel():
            return None
        used = self.get_seq_length()
        if not self._fits(used + 1, self.keys, self.values):
            self._reallocate(used, used + 1, self.keys, self.values)
        return used

    def filled(self, total: int) -> None:
        """The buffers' first `total` positions are written: the keys and values are those."""
        self.keys = self._key_buffer[:, :, :total]
        self.values = self._value_buffer[:, :, :total]

    def _fits(self, total: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the buffers hold `total` positions of these shapes and `keys` is still their view."""
        buffers = self._key_buffer, self._value_buffer
        if buffers[0] is None or total > buffers[0].shape[2]:
            return False
        for buffer, held, states in zip(buffers, (self.keys, self.values), (key_states, value_states), strict=True):
            same_shape = (*buffer.shape[:2], buffer.shape[3]) == (*states.shape[:2], states.shape[3])
            if buffer.dtype != (self.storage or states.dtype) or not same_shape:
                return False
            if held.numel() and held.data_ptr() != buffer.data_ptr():  # transformers replaced it (crop, reorder)
                return False
        return True

    def _reallocate(self, used: int, total: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        positions = self.capacity if total <= self.capacity else 2 * total  # past the hint: room to grow again
        made = []
        for held, states in ((self.keys, key_states), (self.values, value_states)):
            batch, heads, _, dim = states.shape
            buffer = states.new_empty(batch, heads, positions, dim, dtype=self.storage or states.dtype)
            if used:
                buffer[:, :, :used].copy_(held)
            made.append(buffer)
        self._key_buffer, self._value_buffer = made

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def takes_dynamic_cache(model) -> bool:
    """Whether the model runs on a DynamicCache it is handed: transformers' own test before `generate` builds one
    (False for MiniMax, whose forward refuses any cache but its MiniMaxCache of linear-attention state)."""
    return model._supports_default_dynamic_cache()


def engine_cache(model, tokens: int) -> DynamicCache | None:
    """A DynamicCache for one generation of `tokens` positions in all (prompt and new tokens), its full-attention
    layers GrowingLayer (storing in the dtype the loader chose, `kv_storage`); None for a model that builds a cache
    of its own (`takes_dynamic_cache`), which `generate` then lets it build."""
    if not takes_dynamic_cache(model):
        return None
    cache = DynamicCache(config=model.config)
    storage = kv_storage(model)
    cache.layers = [GrowingLayer(tokens, storage) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class StoredLayer(DynamicLayer):
    """transformers' DynamicLayer (serve's batched caches pad, join and drop its rows) keeping its keys and values
    in `storage`: each update rounded to it as it is written."""

    def __init__(self, storage: torch.dtype):
        super().__init__()
        self.storage = storage

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(stored(key_states, self.storage), stored(value_states, self.storage))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return super().update(stored(key_states, self.storage), stored(value_states, self.storage), *args, **kwargs)


def stored_cache(model) -> DynamicCache:
    """A DynamicCache as transformers makes it for `model` (serve's scheduler), its full-attention layers keeping
    keys and values in `kv_storage` where the loader chose one."""
    cache = DynamicCache(config=model.config)
    storage = kv_storage(model)
    if storage is not None:
        cache.layers = [_stored(layer, storage) for layer in cache.layers]
    return cache


Q8_0 = torch.uint8  # a cache of q8_0 blocks is stored as their bytes
KV_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "q8_0": Q8_0}
Q8_VALUES, Q8_BYTES = native.BLOCK_TYPES["Q8_0"].elements, native.BLOCK_TYPES["Q8_0"].bytes  # 32 values in 34 bytes


def stored(states: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """`states` as a cache of `storage` keeps them: rounded to a float dtype, or as q8_0 blocks (states already of
    `storage` as they are)."""
    if storage is Q8_0 and states.dtype is not Q8_0:
        return native.quantize_q8_0(states)
    return states.to(storage)


def widened(cached: torch.Tensor) -> torch.Tensor:
    """A cache view's values in float32: a q8_0 view's blocks decoded (d * q, exactly), any other view as float."""
    if cached.dtype is not Q8_0:
        return cached.float()
    width = cached.shape[-1] // Q8_BYTES * Q8_VALUES
    rows = cached.reshape(-1, cached.shape[-1]).contiguous()
    return native.dequantize(rows, "Q8_0", rows.shape[0], width).view(*cached.shape[:-1], width)


def value_bytes(storage: torch.dtype) -> float:
    """Bytes a cached value takes in `storage` (q8_0: 34 bytes a 32-value block)."""
    return Q8_BYTES / Q8_VALUES if storage is Q8_0 else storage.itemsize


def dtype_name(storage: torch.dtype) -> str:
    """`storage` as --kv-dtype names it."""
    return "q8_0" if storage is Q8_0 else str(storage).removeprefix("torch.")


def kv_dtype_for(kv_dtype: str, latent: bool, model_dir: str, model_type: str) -> torch.dtype | None:
    """The storage dtype `--kv-dtype` names (None: the model's), refused for a name not in KV_DTYPES and for a model
    without latent attention (`latent`), the only cache the engine keeps in another dtype."""
    if kv_dtype not in KV_DTYPES:
        raise WeightstreamError(f"--kv-dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
    storage = KV_DTYPES[kv_dtype]
    if storage is not None and not latent:
        raise WeightstreamError(
            f"--kv-dtype {kv_dtype}: {model_dir} ({model_type}) has no latent attention; the engine keeps other "
            "models' keys and values in the model's dtype: drop --kv-dtype"
        )
    return storage


def store_kv_in(model, kv_dtype: str, latent: bool, form: str, model_dir: str) -> None:
    """Keep the model's latent KV cache in `kv_dtype` (a name of KV_DTYPES; `latent`: whether the model has latent
    attention, `form` its form) in every cache the engine makes (`engine_cache`, `stored_cache`) and in the cache
    transformers' `generate` makes for it; refused where it cannot hold: no latent attention, the expanded form (its
    kv_b_proj takes the model's dtype), cache layers other than DynamicLayer (DeepSeek-V3.2's indexer keeps its own),
    or a native extension built before 16-bit caches. A bare forward without a cache (`model(ids)`) still gets
    transformers' own cache, in the model's dtype."""
    storage = kv_dtype_for(kv_dtype, latent, model_dir, model.config.model_type)
    if storage is None:
        return
    what = f"--kv-dtype {kv_dtype}: {model_dir} ({model.config.model_type})"
    if storage == model.dtype:
        return
    if form != "absorbed":
        raise WeightstreamError(
            f"{what}: --latent-attention {form} runs transformers' form on the model's own dtype ({model.dtype}); "
            "drop one of the two"
        )
    layers = DynamicCache(config=model.config).layers if takes_dynamic_cache(model) else []
    others = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if not layers or others:
        raise WeightstreamError(
            f"{what}: its cache layers ({', '.join(others) or 'a cache of its own'}) are not the plain ones the "
            "engine stores in another dtype: drop --kv-dtype"
        )
    if native.available() and not native.has("latent_cache_dtypes"):
        raise WeightstreamError(
            f"{what}: the native extension was built from older sources, whose latent attention reads float32 caches "
            "only: rebuild it (`pip install --no-build-isolation -e .`) or drop --kv-dtype"
        )
    if storage is Q8_0:
        check_q8_0(model.config.get_text_config(), what)
    model._ws_kv_storage = storage
    prepare = model._prepare_cache_for_generation

    def stored_for_generation(generation_config, model_kwargs, *args, **kwargs):
        done = prepare(generation_config, model_kwargs, *args, **kwargs)
        for key in ("cache", "past_key_values"):  # the name transformers 5.x gives it, and the earlier one
            cache = model_kwargs.get(key)
            if isinstance(cache, DynamicCache):
                cache.layers = [_stored(layer, storage) for layer in cache.layers]
        return done

    model._prepare_cache_for_generation = stored_for_generation


def check_q8_0(text, what: str) -> None:
    """Refuses a q8_0 cache where the native kernels that write and read its blocks are not here, or where the latent
    or the rotary key (of `text`, a model's text config) is not whole 32-value blocks (the engine, and tune's price)."""
    if not native.has("quantize_q8_0"):
        why = native.why_not() or "it was built from older sources, without q8_0 caches"
        raise WeightstreamError(
            f"{what}: a q8_0 cache is written and read by the native kernels, which do not run here ({why}); rebuild "
            "them (`pip install --no-build-isolation -e .`) or give --kv-dtype float16"
        )
    odd = q8_0_odd_dims(text)
    if odd:
        raise WeightstreamError(
            f"{what}: q8_0 stores whole blocks of {Q8_VALUES} values and this model's {' and '.join(odd)} "
            f"{'are' if len(odd) > 1 else 'is'} not; "
            "give --kv-dtype float16"
        )


def _stored(layer, storage: torch.dtype):
    """A fresh DynamicLayer as a StoredLayer; any other layer (or one already holding states) as it is."""
    return StoredLayer(storage) if type(layer) is DynamicLayer and not layer.is_initialized else layer


def kv_storage(model) -> torch.dtype | None:
    """The dtype the engine's cache stores a model's keys and values in (None: as its layers compute them)."""
    return getattr(model, "_ws_kv_storage", None)


@contextlib.contextmanager
def quiet_cache_kwarg():
    """Around a call given `past_key_values=` (`generate`, or a model's forward as serve makes it): later transformers
    5.x name that keyword `cache` and warn for the old name on every call, earlier ones know only `past_key_values`,
    and 5.40 drops it (pyproject stays below), so the engine passes `past_key_values` everywhere."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        yield
