"""Round-to-nearest encoders for GGML's block formats, the ones the native kernels run (native.py).

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


def _scales_mins_k(w: torch.Tensor, levels: int):
    """Q4_K / Q5_K per 32: scale (max - min) / levels and minimum (at most 0), each a 6-bit multiple of its
    super-block's fp16 step; codes rounded against the scale and minimum as stored. Returns (d, dmin, the 12
    packed scale bytes, codes (n, S, 8, 32))."""
    n, k = w.shape
    b = w.float().reshape(n, k // 256, 8, 32)
    lo = b.amin(dim=-1).clamp(max=0)  # (n, S, 8); the format subtracts a non-negative min
    scale, mins = (b.amax(dim=-1) - lo) / levels, -lo
    d = (scale.amax(dim=-1, keepdim=True) / 63).to(torch.float16).float()
    dmin = (mins.amax(dim=-1, keepdim=True) / 63).to(torch.float16).float()
    sc = torch.round(scale / torch.where(d > 0, d, torch.ones_like(d))).clamp(0, 63).to(torch.int32)
    mn = torch.round(mins / torch.where(dmin > 0, dmin, torch.ones_like(dmin))).clamp(0, 63).to(torch.int32)
    step, offset = (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = torch.round((b + offset) * inv).clamp(0, levels).to(torch.uint8)  # (n, S, 8, 32)
    low = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    high = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    scales = torch.cat([low, mid, high], dim=-1).to(torch.uint8)  # (n, S, 12)
    return d, dmin, scales, q


def _k_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(n, S, 8, 32) codes -> (n, S, 128): 64-element chunk c holds sub-block 2c in the low nibbles of its 32
    bytes, 2c + 1 in the high ones."""
    n, s = q.shape[:2]
    return ((q[:, :, 0::2] & 15) | ((q[:, :, 1::2] & 15) << 4)).reshape(n, s, 128)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """Per 32: codes 0..15 against a 6-bit scale and min (`_scales_mins_k`)."""
    n, _ = w.shape
    d, dmin, scales, q = _scales_mins_k(w, 15)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, _k_nibbles(q)], dim=-1).reshape(n, -1)


def quantize_q5_k(w: torch.Tensor) -> torch.Tensor:
    """Q4_K with codes 0..31: the fifth bit of element l of sub-block s is bit s of high-bit byte l."""
    n, _ = w.shape
    d, dmin, scales, q = _scales_mins_k(w, 31)
    shifts = torch.arange(8, dtype=torch.int32).reshape(1, 1, 8, 1)
    qh = ((q.to(torch.int32) >> 4) << shifts).sum(dim=2).to(torch.uint8)  # (n, S, 32)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, qh, _k_nibbles(q)], dim=-1).reshape(n, -1)


def _two_bit_planes(q: torch.Tensor) -> torch.Tensor:
    """(n, S, 8, 32) codes 0..3 -> (n, S, 64): sub-block 4h + j in bits 2j of bytes 32h..32h + 31."""
    n, s = q.shape[:2]
    q = q.to(torch.int32).reshape(n, s, 2, 4, 32) << (2 * torch.arange(4, dtype=torch.int32)).reshape(1, 1, 1, 4, 1)
    return q.sum(dim=3).to(torch.uint8).reshape(n, s, 64)


def quantize_q2_k(w: torch.Tensor) -> torch.Tensor:
    """Per 16: scale (max - min) / 3 and minimum (at most 0) as 4-bit multiples of fp16 steps; codes 0..3."""
    n, k = w.shape
    b = w.float().reshape(n, k // 256, 16, 16)
    lo = b.amin(dim=-1).clamp(max=0)
    scale, mins = (b.amax(dim=-1) - lo) / 3, -lo
    d = (scale.amax(dim=-1, keepdim=True) / 15).to(torch.float16).float()
    dmin = (mins.amax(dim=-1, keepdim=True) / 15).to(torch.float16).float()
    sc = torch.round(scale / torch.where(d > 0, d, torch.ones_like(d))).clamp(0, 15).to(torch.int32)
    mn = torch.round(mins / torch.where(dmin > 0, dmin, torch.ones_like(dmin))).clamp(0, 15).to(torch.int32)
    step, offset = (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)
    q = torch.round((b + offset) * torch.where(step > 0, 1 / step, torch.zeros_like(step))).clamp(0, 3)
    scales = (sc | (mn << 4)).to(torch.uint8)  # (n, S, 16)
    qs = _two_bit_planes(q.reshape(n, k // 256, 8, 32))
    return torch.cat([scales, qs, _fp16_bytes(d), _fp16_bytes(dmin)], dim=-1).reshape(n, -1)


def quantize_q3_k(w: torch.Tensor) -> torch.Tensor:
    """Per 16: the value of largest magnitude is -4 steps (codes -4..3), the step a signed 6-bit multiple of an
    fp16 `d`; codes stored as 2 low bits (Q2_K's planes) and a third bit, set where the code is not below 0."""
    n, k = w.shape
    b = w.float().reshape(n, k // 256, 16, 16)
    scale = (b.gather(-1, b.abs().argmax(dim=-1, keepdim=True)) / -4).squeeze(-1)  # (n, S, 16), signed
    d = (scale.abs().amax(dim=-1, keepdim=True) / 31).to(torch.float16).float()
    sc = torch.round(scale / torch.where(d > 0, d, torch.ones_like(d))).clamp(-32, 31).to(torch.int32)
    step = (d * sc.float()).unsqueeze(-1)
    q = torch.round(b * torch.where(step != 0, 1 / step, torch.zeros_like(step))).clamp(-4, 3).to(torch.int32) + 4
    q = q.reshape(n, k // 256, 8, 32)
    hmask = ((q >> 2) << torch.arange(8, dtype=torch.int32).reshape(1, 1, 8, 1)).sum(dim=2).to(torch.uint8)
    s6 = sc + 32  # (n, S, 16) in 0..63
    low = (s6[..., :8] & 15) | ((s6[..., 8:] & 15) << 4)
    high = sum(((s6[..., 4 * i : 4 * i + 4] >> 4) & 3) << (2 * i) for i in range(4))
    scales = torch.cat([low, high], dim=-1).to(torch.uint8)  # (n, S, 12)
    return torch.cat([hmask, _two_bit_planes(q & 3), scales, _fp16_bytes(d)], dim=-1).reshape(n, -1)


def _gguf_encoder(kind: str):
    """The `gguf` package's own encoder of a type (numpy, round to nearest as llama.cpp's reference)."""

    def encode(w: torch.Tensor) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        out = quants.quantize(w.float().numpy(), GGMLQuantizationType[kind])
        return torch.from_numpy(out).reshape(w.shape[0], -1)

    encode.__name__ = f"quantize_{kind.lower()}"
    encode.__doc__ = f"{kind} blocks by the gguf package's encoder."
    return encode


# MXFP4: per 32 a power-of-two scale and the nearest E2M1 value of each weight, as llama.cpp's converter writes
# gpt-oss's experts; Q5_0/Q5_1: what llama-quantize falls back to in K-quant files where rows are not whole
# super-blocks of 256 (DeepSeek-V2-Lite's expert down projections)
quantize_mxfp4 = _gguf_encoder("MXFP4")
quantize_q5_0 = _gguf_encoder("Q5_0")
quantize_q5_1 = _gguf_encoder("Q5_1")


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
    "Q5_0": quantize_q5_0,
    "Q5_1": quantize_q5_1,
    "Q2_K": quantize_q2_k,
    "Q3_K": quantize_q3_k,
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
    "MXFP4": quantize_mxfp4,
}
