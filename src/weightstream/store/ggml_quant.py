"""Round-to-nearest encoders for GGML's block formats, the ones the native kernels run (engine/native.py).

Each takes a float matrix (N, K) and returns uint8 (N, row bytes): every row its blocks back to back, bytes as a
GGUF file stores them, so a weight quantized here and a weight imported from a GGUF are the same kind of thing.
Formats (docs/kernels.md): Q8_0 (fp16 scale per 32, int8), Q4_0 (fp16 scale per 32, 4-bit codes around 8),
Q4_1 (fp16 scale and minimum per 32, 4-bit codes), Q4_K (per 256: fp16 scale and min of scales, 6-bit scale and
min per 32, 4-bit codes), Q6_K (per 256: fp16 scale, int8 scale per 16, 6-bit codes); and BF16, the weights as
bfloat16, which the kernels multiply by float32 activations.
"""

from __future__ import annotations

import torch


def _fp16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., 32) codes 0..15 -> (..., 16) bytes: element j low nibble of byte j, element j + 16 the high one."""
    return (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    d = (b.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16).float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv).clamp(-127, 127).to(torch.int8)
    return torch.cat([_fp16_bytes(d), q.view(torch.uint8)], dim=-1).reshape(n, -1)


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    lo, hi = b.amin(dim=-1, keepdim=True), b.amax(dim=-1, keepdim=True)
    d = ((hi - lo) / 15).to(torch.float16).float()
    m = lo.to(torch.float16).float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((b - m) * inv).clamp(0, 15).to(torch.uint8)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(m), _nibbles(q)], dim=-1).reshape(n, -1)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """Per 32: scale (max - min) / 15 and minimum (at most 0), each as a 6-bit multiple of its super-block's fp16
    step; codes rounded against the scale and minimum as stored."""
    n, k = w.shape
    b = w.float().reshape(n, k // 256, 8, 32)
    lo = b.amin(dim=-1).clamp(max=0)  # (n, S, 8); the format subtracts a non-negative min
    scale, mins = (b.amax(dim=-1) - lo) / 15, -lo
    d = (scale.amax(dim=-1, keepdim=True) / 63).to(torch.float16).float()
    dmin = (mins.amax(dim=-1, keepdim=True) / 63).to(torch.float16).float()
    sc = torch.round(scale / torch.where(d > 0, d, torch.ones_like(d))).clamp(0, 63).to(torch.int32)
    mn = torch.round(mins / torch.where(dmin > 0, dmin, torch.ones_like(dmin))).clamp(0, 63).to(torch.int32)
    step, offset = (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = torch.round((b + offset) * inv).clamp(0, 15).to(torch.uint8)  # (n, S, 8, 32)
    # 64-element chunk c: sub-block 2c in the low nibbles of its 32 bytes, 2c + 1 in the high ones
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // 256, 128)
    low = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    high = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    scales = torch.cat([low, mid, high], dim=-1).to(torch.uint8)  # (n, S, 12)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, qs], dim=-1).reshape(n, -1)


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """Per 32: the value of largest magnitude is -8 steps (the format's asymmetric range, -8..7)."""
    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    peak = b.gather(-1, b.abs().argmax(dim=-1, keepdim=True))  # signed
    d = (peak / -8).to(torch.float16).float()
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv + 8).clamp(0, 15).to(torch.uint8)
    return torch.cat([_fp16_bytes(d), _nibbles(q)], dim=-1).reshape(n, -1)


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """Per 256: an fp16 step `d`; per 16 an int8 multiple of it; codes -32..31 stored as 4 low bits and 2 high."""
    n, k = w.shape
    b = w.float().reshape(n, k // 256, 16, 16)
    scale = b.abs().amax(dim=-1) / 31  # (n, S, 16)
    d = (scale.amax(dim=-1, keepdim=True) / 127).to(torch.float16).float()
    sc = torch.round(scale / torch.where(d > 0, d, torch.ones_like(d))).clamp(0, 127)
    step = (d * sc).unsqueeze(-1)
    q = torch.round(b * torch.where(step > 0, 1 / step, torch.zeros_like(step))).clamp(-32, 31).to(torch.int32) + 32
    q = q.reshape(n, k // 256, 2, 4, 32)  # half h, quarter r (sub-blocks of 32), element l
    low, high = q & 15, q >> 4
    ql = torch.cat([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], dim=-1)
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    parts = [
        ql.reshape(n, k // 256, 128).to(torch.uint8),
        qh.reshape(n, k // 256, 64).to(torch.uint8),
        sc.to(torch.int8).view(torch.uint8),
        _fp16_bytes(d),
    ]
    return torch.cat(parts, dim=-1).reshape(n, -1)


def encode_bf16(w: torch.Tensor) -> torch.Tensor:
    """Not quantized: each weight rounded to bfloat16 (exact for a bf16 source), its two bytes little-endian."""
    return w.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(w.shape[0], -1)


ENCODERS = {
    "BF16": encode_bf16,
    "Q8_0": quantize_q8_0,
    "Q4_0": quantize_q4_0,
    "Q4_1": quantize_q4_1,
    "Q4_K": quantize_q4_k,
    "Q6_K": quantize_q6_k,
}
