"""The running sequences' KV caches as one left-padded transformers DynamicCache, so a decode step is one forward.

Rows are right-aligned: every row ends at the last column, and column j of a row holds a real position only where
its attention mask is 1. A sequence joins after its own prefill (its cache is left-padded to the batch's length, or
the batch to its), and leaves by row selection; columns that are padding in every row are then dropped, so the
batch is never longer than its longest sequence. The padded cache is what `model.generate` builds for a batch of
left-padded prompts; the mask and per-row positions are the ones it passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from weightstream.engine.batching.sequence import Sequence

BATCHABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def batchable(config) -> bool:
    """Whether this model's cache layers are ones whose rows `DecodeBatch` can pad, join and drop."""
    return all(type(layer) in BATCHABLE_LAYERS for layer in DynamicCache(config=config).layers)


class DecodeBatch:
    """Sequences decoding together: their rows, one padded cache, and the 2D attention mask (B, L)."""

    def __init__(self):
        self.seqs: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (B, L) int64, 1 where a row holds a real position

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def length(self) -> int:
        """L: the padded length of every row."""
        return 0 if self.mask is None else self.mask.shape[1]

    def join(self, seq: Sequence, cache: DynamicCache) -> None:
        """Add a prefilled sequence whose batch-of-one cache holds its prompt."""
        length = cache.layers[0].get_seq_length()
        mask = torch.ones(1, length, dtype=torch.long)
        if not self.seqs:
            self.seqs, self.cache, self.mask = [seq], cache, mask
            return
        new_length = max(self.length, length)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            _join_layer(mine, theirs, new_length)
        self.mask = torch.cat([_pad_left(self.mask, new_length), _pad_left(mask, new_length)])
        self.seqs.append(seq)

    def leave(self, gone: set[int]) -> None:
        """Drop the rows of the sequences whose ids are in `gone`, then the columns no row needs any more."""
        keep = [i for i, s in enumerate(self.seqs) if s.id not in gone]
        if len(keep) == len(self.seqs):
            return
        if not keep:
            self.seqs, self.cache, self.mask = [], None, None
            return
        rows = torch.tensor(keep)
        self.seqs = [self.seqs[i] for i in keep]
        self.mask = self.mask[rows]
        self.cache.batch_select_indices(rows)
        self._trim()

    def step_inputs(self) -> dict:
        """Forward arguments for one decode step of every row: each row's last token at its own position."""
        positions = self.mask.sum(dim=1, keepdim=True)  # (B, 1) real positions so far = the next one's index
        self.mask = torch.cat([self.mask, torch.ones(len(self.seqs), 1, dtype=torch.long)], dim=1)
        return {
            "input_ids": torch.tensor([[s.generated[-1]] for s in self.seqs]),
            "attention_mask": self.mask,
            "position_ids": positions,
            "past_key_values": self.cache,
        }

    def kv_bytes(self) -> int:
        """Bytes the batch's KV tensors hold now."""
        if self.cache is None:
            return 0
        return sum(t.nbytes for layer in self.cache.layers for t in (layer.keys, layer.values) if t is not None)

    def _trim(self) -> None:
        dead = int(self.mask.any(dim=0).long().argmax())  # leading columns that are padding in every row
        if dead == 0:
            return
        self.mask = self.mask[:, dead:]
        for layer in self.cache.layers:
            _trim_layer(layer, self.length)


def _pad_left(t: torch.Tensor, length: int, dim: int = -1) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (-dim - 1) + [missing, 0]  # F.pad counts dimensions from the last
    return F.pad(t, pad)


def _join_layer(mine, theirs, new_length: int) -> None:
    """Stack one layer's rows: both sides right-aligned to the longer stored length (a window may cap it)."""
    stored = max(mine.keys.shape[-2], theirs.keys.shape[-2])
    mine.keys = torch.cat([_pad_left(mine.keys, stored, -2), _pad_left(theirs.keys, stored, -2)])
    mine.values = torch.cat([_pad_left(mine.values, stored, -2), _pad_left(theirs.values, stored, -2)])
    if isinstance(mine, DynamicSlidingWindowLayer):
        mine.cumulative_length = new_length  # positions seen, padding included, as for a padded prompt batch


def _trim_layer(layer, new_length: int) -> None:
    """Keep at most the last `new_length` stored positions (a sliding layer may already store fewer)."""
    stored = layer.keys.shape[-2]
    keep = min(stored, new_length)
    layer.keys, layer.values = layer.keys[..., stored - keep :, :], layer.values[..., stored - keep :, :]
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = new_length
