"""Dense modules the loader puts in a model's place: a Linear whose weight is GGML blocks, and an embedding kept
in its stored dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightstream import native
from weightstream.engine.kernels.quantized import native_dequant_rows, native_product


class NativeLinear(torch.nn.Module):
    """A dense Linear whose weight is GGML blocks (`quantize --dense`), computed as the experts' are
    (`native_product`)."""

    def __init__(self, blocks: torch.Tensor, wtype: str, n: int, k: int, bias: torch.nn.Parameter | None):
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.wtype, self.in_features, self.out_features = wtype, k, n
        self.bias = bias
        self.dequant_rows = native_dequant_rows((wtype,))  # decided once: forward is on every token's path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.dequant_rows * self.in_features:  # one op, as native_product's product
            return native.linear(x, self.blocks, self.wtype, self.out_features, self.in_features, self.bias)
        rows = x.reshape(-1, self.in_features)
        y = native_product(rows, self.blocks, self.wtype, self.out_features, self.in_features, self.dequant_rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class StoredEmbedding(torch.nn.Module):
    """An input embedding kept in the dtype it is stored in (a buffer, so the model's dtype is that of its
    parameters), its rows converted to the compute dtype as they are looked up: a quantized-dense model computes
    in float32 without a float32 copy of the table, of which a token reads one row."""

    def __init__(self, table: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", table, persistent=False)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.dtype)  # no padding_idx: see `lookup_without_padding`


def lookup_without_padding(embedding: torch.nn.Module) -> None:
    """An nn.Embedding's padding_idx dropped: it only keeps that row's gradient at zero, and given to F.embedding it
    also takes torch's slow path (0.2-0.7 ms for one row of a 102400 x 2048 bf16 table, 4 us without; the same
    bits). The engine never trains."""
    if isinstance(embedding, torch.nn.Embedding):
        embedding.padding_idx = None
