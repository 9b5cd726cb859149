"""Next-layer expert prediction: layer L's FFN input times layer L+1's router weight, top-k, read ahead early.

The residual stream changes little from one layer to the next, so the router of layer L+1 applied to what
layer L's experts receive guesses most of L+1's choices one layer ahead. A guess only decides what is read
early; the experts computed are always the router's own, so tokens never change.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from weightstream.errors import WeightstreamError
from weightstream.store.layout import ModelLayout


@dataclass(frozen=True, slots=True)
class Router:
    """A layer's router as a linear map: logits = hidden @ weight.T + bias."""

    weight: torch.Tensor  # (E, D)
    bias: torch.Tensor | None  # (E,)


@dataclass(slots=True)
class PredictionCounters:
    """How many of the layers' actual top-k choices had been predicted one layer ahead."""

    checked: int = 0  # actual (token, choice) pairs of layers that had a prediction
    predicted: int = 0  # of those, how many the prediction contained

    @property
    def accuracy(self) -> float:
        return self.predicted / self.checked if self.checked else 0.0


def find_router(model: torch.nn.Module, experts_path: str, num_experts: int, hidden: int) -> Router:
    """The sibling of an experts module that holds a (num_experts, hidden) weight: `mlp.gate`, gpt_oss `mlp.router`."""
    parent = model.get_submodule(experts_path.rpartition(".")[0])
    for name, child in parent.named_children():
        weight = getattr(child, "weight", None)
        if name == experts_path.rpartition(".")[2] or not isinstance(weight, torch.Tensor):
            continue
        if tuple(weight.shape) == (num_experts, hidden):
            bias = getattr(child, "bias", None)
            bias = bias if isinstance(bias, torch.Tensor) and tuple(bias.shape) == (num_experts,) else None
            return Router(weight.detach(), None if bias is None else bias.detach())
    raise WeightstreamError(
        f"--predict-next: no router next to {experts_path} (a sibling module with a weight of "
        f"shape ({num_experts}, {hidden})); run this model without --predict-next"
    )


class NextLayerPredictor:
    """At each MoE layer: scores the prediction made for it, and predicts the next MoE layer's experts."""

    def __init__(self, model: torch.nn.Module, layout: ModelLayout, n_slots: int):
        hidden = model.config.get_text_config().hidden_size
        path_of = {layer: path for path, layer in layout.module_layers.items()}
        layers = layout.layers
        self.next_layer = dict(pairwise(layers))  # the last MoE layer predicts nothing
        self.routers = {
            layer: find_router(model, path_of[layer], layout.num_experts[layer], hidden) for layer in layers[1:]
        }
        self.top_k = layout.top_k
        # a prefill step's tokens predict many experts: read ahead at most the layer's fair share of the cache
        self.limit = max(self.top_k, n_slots // len(layers))
        self.pending: dict[int, torch.Tensor] = {}  # layer -> predicted (T, k) expert ids
        self.counters = PredictionCounters()

    def score(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Count how many of `layer`'s actual choices (T, k) were predicted for the same tokens."""
        predicted = self.pending.pop(layer, None)
        if predicted is None or predicted.shape[0] != top_k_index.shape[0]:
            return
        found = (top_k_index.unsqueeze(-1) == predicted.unsqueeze(-2)).any(-1)  # (T, k)
        self.counters.checked += found.numel()
        self.counters.predicted += int(found.sum())

    def predict(self, layer: int, hidden_states: torch.Tensor) -> tuple[int, list[int]] | None:
        """(next MoE layer, experts to read ahead, most-voted first) from this layer's FFN input (T, D)."""
        nxt = self.next_layer.get(layer)
        if nxt is None:
            return None
        router = self.routers[nxt]
        logits = F.linear(hidden_states.to(router.weight.dtype), router.weight, router.bias)  # (T, E)
        chosen = logits.topk(self.top_k, dim=-1).indices  # (T, k): softmax and sigmoid keep the order
        self.pending[nxt] = chosen
        votes = Counter(chosen.reshape(-1).tolist())
        ranked = sorted(votes, key=lambda e: (-votes[e], e))
        return nxt, ranked[: self.limit]
