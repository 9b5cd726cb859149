"""Random rows of GGML blocks for timing the native products: every code pattern, with fp16 scales in a sane range
(random bytes there would be NaNs and infinities, and MXFP4's shared exponents around 2^0). Needs numpy and gguf
only, so a timed child process of any build can import it (common/products.py)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

# where each type keeps its fp16 scales (d, and dmin or m where it has one): byte offsets in the block
FP16_SCALES = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
}


def random_blocks(wtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of k weights as `wtype`'s blocks, flat uint8, drawn from `rng` (the same draws for the same seed)."""
    block, size = quants.GGML_QUANT_SIZES[getattr(GGMLQuantizationType, wtype)]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    if wtype == "MXFP4":
        raw[..., 0] = rng.integers(118, 134, size=raw.shape[:2], dtype=np.uint8)
    for at in FP16_SCALES.get(wtype, ()):
        raw[..., at : at + 2] = rng.uniform(1e-4, 1e-2, size=raw.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1).copy()
