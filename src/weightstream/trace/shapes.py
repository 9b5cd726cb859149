"""Model shapes for routing traces: which layers route, how many experts, top-k, and bytes of one expert.

Named shapes are the real models' ``config.json`` fields (``store.presets.REAL``), so a name and a config file go
through one parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from weightstream.errors import WeightstreamError
from weightstream.store.dtypes import ELEMENT_BYTES, FLOATS, TORCH_NAME_BYTES, weights_dtype
from weightstream.store.facts import TOP_K_FIELDS, top_k
from weightstream.store.presets import REAL
from weightstream.store.safetensors_index import read_safetensors_header

# (layer, expert) pairs of one shape at most: the simulator's dense arrays are indexed by them (2^24 is ~1000x the
# largest MoE models' ~15,000: DeepSeek-V3's 58 routed layers x 256 experts)
MAX_EXPERT_KEYS = 2**24


@dataclass(slots=True)
class ModelShape:
    """What a trace needs to know about its model: routed layers, experts per layer, top-k, expert bytes."""

    name: str
    layers: list[int]  # model layer indices that route to experts, ascending
    n_experts: int  # routed experts per layer
    top_k: int  # experts chosen per token per layer
    expert_bytes: list[int] = field(default_factory=list)  # bytes of one expert, per entry of `layers`

    def __post_init__(self):
        if not self.layers or sorted(set(self.layers)) != list(self.layers):
            raise WeightstreamError(f"model shape {self.name!r}: layers must be a non-empty ascending list")
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise WeightstreamError(
                f"model shape {self.name!r}: need 1 <= top_k ({self.top_k}) <= experts ({self.n_experts})"
            )
        if len(self.expert_bytes) != len(self.layers) or min(self.expert_bytes) < 1:
            raise WeightstreamError(f"model shape {self.name!r}: need one positive expert size per routed layer")
        if len(self.layers) * self.n_experts > MAX_EXPERT_KEYS:  # the simulator holds arrays over every key
            raise WeightstreamError(
                f"model shape {self.name!r}: {len(self.layers)} routed layers x {self.n_experts} experts are more "
                f"than the {MAX_EXPERT_KEYS} (layer, expert) pairs a trace may name; is the shape damaged?"
            )

    @property
    def uniform_bytes(self) -> int | None:
        """Bytes of one expert when every layer's experts are the same size, else None."""
        return self.expert_bytes[0] if len(set(self.expert_bytes)) == 1 else None

    @property
    def working_set_slots(self) -> int:
        """Experts one decode token touches across all routed layers."""
        return self.top_k * len(self.layers)

    @property
    def working_set_bytes(self) -> int:
        """Bytes one decode token touches across all routed layers."""
        return self.top_k * sum(self.expert_bytes)

    def to_dict(self) -> dict:
        """Plain JSON-able form (stored inside trace files)."""
        return {
            "name": self.name,
            "layers": list(self.layers),
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "expert_bytes": list(self.expert_bytes),
        }


def _moe_layers(cfg: dict) -> list[int]:
    n = int(cfg["num_hidden_layers"])
    kind = cfg.get("model_type", "")
    if "first_k_dense_replace" in cfg or kind.startswith("deepseek"):
        first, freq = int(cfg.get("first_k_dense_replace", 0)), int(cfg.get("moe_layer_freq", 1))
        return [i for i in range(n) if i >= first and i % freq == 0]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
        dense, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step", 1) or 1)
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    return list(range(n))


def _first(cfg: dict, keys: tuple[str, ...], what: str, source: str) -> int:
    for key in keys:
        if cfg.get(key):
            return int(cfg[key])
    raise WeightstreamError(f"{source}: no {what} field ({' / '.join(keys)}); is this a MoE model's config.json?")


def shape_from_config(cfg: dict, name: str, source: str = "config", dtype_bytes: int | None = None) -> ModelShape:
    """Derive a shape from transformers config fields; expert bytes = 3 x hidden x intermediate x dtype (+ biases),
    the dtype `dtype_bytes` wide, else as the config says (a named shape has no checkpoint to weigh)."""
    cfg = cfg.get("text_config", cfg)
    hidden = _first(cfg, ("hidden_size",), "hidden size", source)
    inter = _first(cfg, ("moe_intermediate_size", "intermediate_size"), "expert intermediate size", source)
    experts = _first(cfg, ("n_routed_experts", "num_local_experts", "num_experts"), "expert count", source)
    k = top_k(cfg)
    if k is None:
        raise WeightstreamError(
            f"{source}: no top-k field ({' / '.join(TOP_K_FIELDS)}); is this a MoE model's config.json?"
        )
    width = dtype_bytes or TORCH_NAME_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), 2)
    params = 3 * hidden * inter
    if cfg.get("model_type") == "gpt_oss":  # gate_up bias (2 x inter) and down bias (hidden) per expert
        params += 2 * inter + hidden
    layers = _moe_layers(cfg)
    return ModelShape(name, layers, experts, k, [params * width] * len(layers))


def resolve_shape(spec: str, expert_bytes: int | None = None) -> ModelShape:
    """A shape from a known name or a path to config.json; `expert_bytes` overrides the derived size."""
    if spec in REAL:
        shape = shape_from_config(REAL[spec], spec, source=spec)
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise WeightstreamError(
                f"model shape {spec!r} is neither a known name ({', '.join(REAL)}) nor an existing config.json"
            )
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise WeightstreamError(f"{path}: not valid JSON ({exc}); pass a transformers config.json") from None
        name = str(cfg.get("_name_or_path") or path.parent.name)
        shape = shape_from_config(cfg, name, source=str(path), dtype_bytes=stored_width(path.parent))
    if expert_bytes is not None:
        if expert_bytes < 1:
            raise WeightstreamError(f"--expert-bytes must be positive, got {expert_bytes}")
        shape.expert_bytes = [expert_bytes] * len(shape.layers)
    return shape


def stored_width(directory: Path) -> int | None:
    """Bytes per element of the float dtype a checkpoint's float tensors are mostly in (`store.dtypes.weights_dtype`,
    the rule the engine builds its model by), None where `directory` holds no safetensors file (a config alone)."""
    tensors = [t for f in sorted(directory.glob("*.safetensors")) for t in read_safetensors_header(str(f)).values()]
    dtype = weights_dtype(t for t in tensors if t.dtype in FLOATS)
    return ELEMENT_BYTES[dtype] if dtype else None
