"""weightstream's native CPU kernels (csrc/, built by pip as the extension `weightstream._native`), below every
package: store/ writes the block formats this table defines, engine/ runs them.

Products of weights in GGML's block formats (the byte layouts GGUF files store: `BLOCK_TYPES`) with
activations quantized to int8 in blocks of 32 (256 for the K types), summed in integers, and of bf16 weights
with float32 activations (BF16, summed in float32 fused multiply-adds): an AVX2 path and a portable path that is
its reference, chosen at run time by a CPU check, bitwise equal to each other and independent of the thread
count (docs/kernels.md). Registered as torch ops (`torch.ops.weightstream.qmm`, `.linear`, `.dequantize`, per MoE
layer `.moe_layer`, `.moe_contribute`, `.moe_sum`, and the float32 steps between products, `.rms_norm` and `.rope`:
engine/fused.py; DeepSeek's `.latent_attend`, and a decode row's attention half, router and MLP half, `.mla_decode`,
`.route_decode`, `.mlp_decode`: engine/lean_layer.py), run on torch's intra-op threads.

When the extension was not built (no compiler or no torch at install time) or is disabled with
WEIGHTSTREAM_NATIVE=0, `available()` is False and callers run torch's own kernels; that is said once.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import torch


class BlockType(NamedTuple):
    """One GGML block type the kernels run: weights a block, bytes a block, GGML's type id, and the block of
    activations it meets (0: float32 activations, not quantized)."""

    elements: int
    bytes: int
    id: int
    act: int


# The one Python table of block types; the extension's own (csrc/qmm.cpp WS_TYPES) is checked against it at load.
BLOCK_TYPES = {
    "Q8_0": BlockType(32, 34, 8, 32),
    "Q4_0": BlockType(32, 18, 2, 32),
    "Q4_1": BlockType(32, 20, 3, 32),
    "Q5_0": BlockType(32, 22, 6, 32),
    "Q5_1": BlockType(32, 24, 7, 32),
    "Q2_K": BlockType(256, 84, 10, 256),
    "Q3_K": BlockType(256, 110, 11, 256),
    "Q4_K": BlockType(256, 144, 12, 256),
    "Q5_K": BlockType(256, 176, 13, 256),
    "Q6_K": BlockType(256, 210, 14, 256),
    "MXFP4": BlockType(32, 17, 39, 32),
    "BF16": BlockType(32, 64, 30, 0),
}
TYPE_IDS = {name: t.id for name, t in BLOCK_TYPES.items()}


def row_bytes(wtype: str, k: int) -> int:
    """Bytes of one row of `k` weights (whole blocks) in GGML block type `wtype`."""
    return k // BLOCK_TYPES[wtype].elements * BLOCK_TYPES[wtype].bytes


# auto: the best this CPU runs (multi-row tiles from `tile_rows(wtype)` rows, AVX-512 VNNI's where the CPU has it, else
# AVX2's; fewer rows as AVX2 rows; portable rows without AVX2); avx512 and avx2-tiles: those tiles at every row
# count; portable and avx2: one row at a time (avx2 with its AVX-512 VNNI variants where the CPU has them;
# avx2-rows without them, AVX2's own body: what a CPU without AVX-512 runs). Every path gives the same bits
# (docs/kernels.md).
PATHS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx2-tiles": 4, "avx2-rows": 5}

_module = None
_why_not: str | None = None
_said = False


def _load():
    global _module, _why_not
    if _module is not None or _why_not is not None:
        return
    if os.environ.get("WEIGHTSTREAM_NATIVE", "1") == "0":
        _why_not = "WEIGHTSTREAM_NATIVE=0"
        return
    try:
        from weightstream import _native
    except ImportError as exc:
        _why_not = (
            f"the extension weightstream._native is not built or does not load ({exc}); reinstall with "
            "`pip install --no-build-isolation -e .` where torch and a C++ compiler are installed"
        )
        return
    built = {name: BlockType(elements, nbytes, id_, act) for name, id_, elements, nbytes, act in _native.block_types()}
    if built != BLOCK_TYPES:
        _why_not = (
            f"the extension weightstream._native was built from other sources (its block types {sorted(built)} do not "
            f"match this package's {sorted(BLOCK_TYPES)}); rebuild it with `pip install --no-build-isolation -e .`"
        )
        return
    _module = _native


def available() -> bool:
    """Whether the native kernels run here; the first time they do not, stderr says why (once per process)."""
    global _said
    _load()
    if _module is None and not _said:
        _said = True
        print(f"weightstream: native kernels off, torch's kernels run instead: {_why_not}", file=sys.stderr)
    return _module is not None


def has(op: str) -> bool:
    """Whether the loaded extension registers `op` (one built from older sources may lack the newest ops)."""
    return available() and hasattr(torch.ops.weightstream, op)


def why_not() -> str | None:
    _load()
    return _why_not


def best_path() -> str:
    """The path `auto` takes on this CPU."""
    return "avx2" if available() and _module.avx2() else "portable"


def tiles_available() -> bool:
    """Whether this CPU runs the multi-row tiles (AVX2, or AVX-512 with VNNI), which auto takes from
    `tile_rows(wtype)` rows."""
    return available() and _module.avx2()


def vnni_available() -> bool:
    """Whether this CPU runs the tiles' AVX-512 VNNI kernel (path "avx512"); without it they run on AVX2."""
    return available() and _module.vnni()


def tile_rows(wtype: str) -> int:
    """Rows of a product of block type `wtype` from which auto computes them as tiles on this CPU."""
    return _module.tile_rows(TYPE_IDS[wtype])


def qmm(x: torch.Tensor, w: torch.Tensor, wtype: str, n: int, k: int, path: str = "auto") -> torch.Tensor:
    """x (M, K) times the (N, K) matrix whose rows `w` (uint8, N x row_bytes) encodes; float32 (M, N)."""
    return torch.ops.weightstream.qmm(x, w, TYPE_IDS[wtype], n, k, PATHS[path])


def linear(x: torch.Tensor, w: torch.Tensor, wtype: str, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) times W^T (+ bias), (..., N) in x's dtype: a dense Linear whose weight is blocks, in one call."""
    return torch.ops.weightstream.linear(x, w, TYPE_IDS[wtype], n, k, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)), float32: transformers' RMSNorm in one call (csrc/layers.cpp)."""
    return torch.ops.weightstream.rms_norm(x, weight, eps)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (B, H, S, D) times cos plus rotate_half times sin, float32, bitwise the standard rotary embedding;
    `interleaved`: bitwise DeepSeek-V3's (pairs of even and odd elements, the first half of cos and sin)."""
    return torch.ops.weightstream.rope(q, k, cos, sin, interleaved)


def rope_pairs(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (B, H, S, D) rotated as complex pairs by `freqs` (B or 1, S, D/2, 2: view_as_real of complex
    frequencies), float32: bitwise DeepSeek-V2's apply_rotary_emb where torch multiplies complex floats as
    (ac - bd, ad + bc)."""
    return torch.ops.weightstream.rope_pairs(q, k, freqs)


def heads_product(x: torch.Tensor, w: torch.Tensor, wtype: str, n: int) -> torch.Tensor:
    """(H, M, N) float32: each head's rows x[h] (M, K) times its own N x K matrix, rows h N .. (h + 1) N of `w`."""
    return torch.ops.weightstream.heads_product(x, w, TYPE_IDS[wtype], n)


def mla_decode(h: torch.Tensor, plan, rot_a, rot_b, rot_kind: int, c_buf, r_buf, used: int):
    """One decode row of a DeepSeek layer's attention half (csrc/decode.cpp): (h + attention, its post-attention
    norm); `plan` an engine/lean_layer.py `LeanLayer`'s weights and sizes; rot_a, rot_b, rot_kind: (cos, sin) and
    whether interleaved, or V2's complex frequencies; the cache buffers' position `used` written."""
    return torch.ops.weightstream.mla_decode(
        h, plan.w, plan.types, plan.rows, plan.cols, plan.k_b, plan.k_type, plan.v_b, plan.v_type, plan.norms,
        plan.eps, rot_a, rot_b, rot_kind, c_buf, r_buf, used, plan.dims, plan.scale,
    )  # fmt: skip


def mlp_decode(x, residual, w, types, rows, cols, routed: torch.Tensor | None = None) -> torch.Tensor:
    """residual + (routed + down(silu(gate(x)) * up(x))), or without routed (a dense MLP): the MLP half of a DeepSeek
    layer's decode row (csrc/decode.cpp); w: [gate, up, down] blocks of `types` (ids), rows x cols each."""
    return torch.ops.weightstream.mlp_decode(x, residual, w, types, rows, cols, routed)


def route_decode(row, weight, bias, kind: int, top_k: int, norm: bool, scaling: float):
    """A DeepSeek router's (top-k weights, top-k indices) of one float32 row: kind 0 V3's sigmoid scores chosen with
    `bias`, normalized if `norm`; kind 1 V2's softmax; times `scaling` (engine/lean_moe.py's routers)."""
    return torch.ops.weightstream.route_decode(row, weight, bias, kind, top_k, norm, scaling)


def latent_attend(
    q_lat: torch.Tensor, q_rot: torch.Tensor, c: torch.Tensor, r: torch.Tensor, scale: float
) -> torch.Tensor:
    """(B, H, L) softmax-weighted latents of one query row a sequence over every cached position, float32: DeepSeek's
    absorbed attention in one pass over the cache (csrc/latent.cpp)."""
    return torch.ops.weightstream.latent_attend(q_lat, q_rot, c, r, scale)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x (..., n), n whole blocks of 32 values, as q8_0 blocks (..., n / 32 * 34) uint8, as ggml rounds them
    (csrc/latent.cpp): a q8_0 latent cache's rows."""
    return torch.ops.weightstream.quantize_q8_0(x)


GATES = ("silu", "clamped-swiglu")  # the gates moe_layer runs, in the extension's numbering


def moe_layer(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: list[int],
    gate_up: list[torch.Tensor],
    gate_up_type: str,
    down: list[torch.Tensor],
    down_type: str,
    into: torch.Tensor | None = None,
    gate_up_bias: list[torch.Tensor] | None = None,
    down_bias: list[torch.Tensor] | None = None,
    gate: str = "silu",
    alpha: float = 0.0,
    limit: float = 0.0,
    path: str = "auto",
) -> torch.Tensor | None:
    """One MoE layer's experts in one call: for each token, the sum over its routed experts (ascending expert
    order, float32) of (gate(x GU^T + b_gu) D^T + b_d) times the router weight; `experts` the routed experts,
    `gate_up[i]` / `down[i]` expert i's (2I, D) and (D, I) blocks, the biases (one per expert) optional.
    (tokens, hidden) in x's dtype. The gate: "silu", silu(G) * U with GU = [G; U] stacked; "clamped-swiglu",
    gpt-oss's: G and U interleaved (row 2j, 2j + 1), g = min(G, limit), u = clamp(U, -limit, limit),
    (u + 1) * g * sigmoid(alpha g).

    With `into` (float32 (tokens, top_k, hidden)), only these experts' (token, choice) rows of the contributions are
    filled, and nothing is summed: `moe_sum` then adds the rows as the single call does, so a layer computed in
    groups (resident experts first, each missing one as it arrives) gives the same bits. `path` as `qmm`'s: auto
    computes an expert's rows as tiles from 4 of them where the CPU runs tiles, every path the same bits."""
    args = (experts, gate_up, TYPE_IDS[gate_up_type], down, TYPE_IDS[down_type], gate_up_bias or [], down_bias or [])
    args += (GATES.index(gate), alpha, limit, PATHS[path])
    if into is None:
        return torch.ops.weightstream.moe_layer(x, top_k_index, top_k_weights, *args)
    torch.ops.weightstream.moe_contribute(into, x, top_k_index, top_k_weights, *args)
    return None


def moe_sum(contrib: torch.Tensor, top_k_index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each token's contributions added in ascending expert order, in float32, returned in `like`'s dtype."""
    return torch.ops.weightstream.moe_sum(contrib, top_k_index, like)


def dequantize(w: torch.Tensor, wtype: str, n: int, k: int) -> torch.Tensor:
    """float32 (N, K): every weight as its block encodes it."""
    return torch.ops.weightstream.dequantize(w, TYPE_IDS[wtype], n, k)
