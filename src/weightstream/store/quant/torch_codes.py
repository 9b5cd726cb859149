"""Round-to-nearest quantization of expert weights, and the int4 layout torch's CPU kernel takes.

int8: symmetric, one scale per output channel: q = round(w / s), s = max|w| / 127, w ~ q * s.
int4: asymmetric, one (scale, zero) per group of `group` inputs of an output channel, as torch's
`_weight_int4pack_mm_for_cpu` expects them: q = round((w - min) / s) in 0..15, s = (max - min) / 15,
zero = min + 8 s, so w ~ (q - 8) s + zero.

torch packs int4 weights for its CPU kernel in a layout that depends on the CPU's vector width (AVX-512: blocks of
64 output channels, two lanes per byte; AVX2: blocks of 32; otherwise plain pairs). Packed bytes are stored as the
kernel takes them, so a checkpoint records which layout it holds and a machine whose torch packs otherwise refuses
it. The layouts are written out here too, so the bytes can be unpacked again (for the prefill route that
dequantizes once and multiplies in the activation dtype) and checked against torch's own packer.
"""

from __future__ import annotations

import torch

INT4_GROUPS = (32, 64, 128, 256)  # what torch's int4 CPU kernel accepts
# layout -> (output channels per block, whether full blocks pair channel c with c + block/2 in a byte)
INT4_LAYOUTS = {"avx512": (64, True), "avx2": (32, True), "pairs": (32, False)}


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N, K), scales (N,) in `dtype`) of w (N, K); the scales are rounded to `dtype` before q is taken."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w ~ q * s, in the scales' dtype (q is exact in it; the product is rounded once, as in float32 then cast)."""
    return q.to(scales.dtype) * scales[:, None]


def quantize_int4(w: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 (N, K) in 0..15, scales_and_zeros (K / group, N, 2) in `dtype`) of w (N, K)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    low, high = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(dtype).float()
    zeros = (low + 8 * scales).to(dtype).float()
    q = torch.round((g - (zeros - 8 * scales)) / scales).clamp(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (K/g, N, 2)
    return q, sz


def dequantize_int4(q: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """w ~ (q - 8) * scale + zero, in the scales' dtype; q is int (N, K) in 0..15."""
    n, k = q.shape
    scale, zero = sz.transpose(0, 1).unsqueeze(-1).unbind(dim=2)  # (N, K/g, 1) each
    w = q.to(sz.dtype).reshape(n, k // group, group).sub_(8).mul_(scale).add_(zero)
    return w.reshape(n, k)


def pack_int4(q: torch.Tensor, layout: str) -> torch.Tensor:
    """uint8 (N, K / 2) of q int (N, K) in 0..15, in `layout` (what torch's packer writes on such a CPU)."""
    n, k = q.shape
    block, lanes = INT4_LAYOUTS[layout]
    q = q.to(torch.uint8)
    parts = [_pack_block(q[b0 : b0 + block], lanes and min(block, n - b0) == block) for b0 in range(0, n, block)]
    return torch.cat([p.reshape(-1) for p in parts]).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """q uint8 (N, K) in 0..15 of torch-packed int4 bytes (N, K / 2) in `layout`."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    block, lanes = INT4_LAYOUTS[layout]
    if n % block == 0:  # every block full: all at once
        data = packed.reshape(n // block, k, block // 2)
        low, high = data & 0x0F, data >> 4
        cols = torch.cat([low, high], dim=2) if lanes else torch.stack([low, high], dim=3).reshape(n // block, k, block)
        return cols.transpose(1, 2).reshape(n, k)
    flat = packed.reshape(-1)
    out = []
    for b0 in range(0, n, block):
        nb = min(block, n - b0)
        out.append(_unpack_block(flat[b0 * k // 2 : (b0 + nb) * k // 2], nb, k, lanes and nb == block))
    return torch.cat(out)


def _pack_block(rows: torch.Tensor, lanes: bool) -> torch.Tensor:
    # rows (nb, K) -> bytes (K, nb / 2): per input k, the block's output channels, two per byte
    cols = rows.t()  # (K, nb)
    half = cols.shape[1] // 2
    low, high = (cols[:, :half], cols[:, half:]) if lanes else (cols[:, 0::2], cols[:, 1::2])
    return (high << 4) | low


def _unpack_block(data: torch.Tensor, nb: int, k: int, lanes: bool) -> torch.Tensor:
    data = data.reshape(k, nb // 2)
    low, high = data & 0x0F, data >> 4
    cols = torch.cat([low, high], dim=1) if lanes else torch.stack([low, high], dim=2).reshape(k, nb)
    return cols.t().contiguous()  # (nb, K)


def torch_int4_layout() -> str | None:
    """Which layout this machine's torch packs int4 in (None: none of those known here)."""
    probe = (torch.arange(208 * 64, dtype=torch.int32).reshape(208, 64) * 7 + 3) % 16  # 208: full blocks and a tail
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    return next((name for name in INT4_LAYOUTS if torch.equal(pack_int4(probe, name), packed)), None)
