"""Record the router's choices of a running model into a trace, and replay a recorded trace instead of the router."""

from __future__ import annotations

import numpy as np
import torch

from weightstream.errors import WeightstreamError
from weightstream.store.layout import ModelLayout
from weightstream.trace import ModelShape, Trace, TraceWriter
from weightstream.trace.remap import token_rows


def layout_shape(layout: ModelLayout, name: str) -> ModelShape:
    """The trace shape of a streamed model: its routed layers, experts, top-k and expert bytes."""
    layers = layout.layers
    n_experts = {layout.num_experts[layer] for layer in layers}
    if len(n_experts) != 1:
        raise WeightstreamError(f"{name}: layers have different expert counts {sorted(n_experts)}; traces need one")
    sizes = [max(layout.experts[(layer, e)].nbytes for e in range(layout.num_experts[layer])) for layer in layers]
    return ModelShape(name, layers, n_experts.pop(), layout.top_k, sizes)


class RoutingRecorder:
    """Observer for StreamingRuntime: one trace step per forward pass, prefill first then decode."""

    def __init__(self, layout: ModelLayout, name: str):
        self.writer = TraceWriter(layout_shape(layout, name), source=name)
        self.first_layer = layout.layers[0]
        self.request: str = "0"
        self._started: set[str] = set()

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        if layer == self.first_layer:
            phase = "decode" if self.request in self._started else "prefill"
            self._started.add(self.request)
            self.writer.begin_step(self.request, phase, n_tokens=top_k_index.shape[0])
        self.writer.add(layer, top_k_index.reshape(-1).tolist(), top_k_weights.reshape(-1).float().tolist())

    def finish(self) -> Trace:
        return self.writer.finish()


class RoutingReplay:
    """Routing override: the router's top-k is replaced, token by token, by a recorded trace's choices.

    Model routed layer i replays trace routed layer i (wrapping when the model has more layers than the trace);
    the trace is replayed from its first token and wraps at its end. Weights become uniform over the replayed
    choices: replay reproduces reads and compute, not text, so tokens are not compared in this mode.
    """

    def __init__(self, trace: Trace, layout: ModelLayout):
        n_model = min(layout.num_experts.values())
        if trace.shape.n_experts > n_model:
            raise WeightstreamError(
                f"routing trace {trace.shape.name!r} has {trace.shape.n_experts} experts per "
                f"layer; this model has {n_model}; replay it on a model with at least as many"
            )
        self.choices = token_rows(trace)
        self.layer_pos = {layer: i % self.choices.shape[1] for i, layer in enumerate(layout.layers)}
        self.first_layer = layout.layers[0]
        self.cursor, self._last_tokens = 0, 0
        self.name = trace.shape.name

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens = top_k_index.shape[0]
        if layer == self.first_layer:
            self.cursor += self._last_tokens
            self._last_tokens = tokens
        return self.replayed(self.cursor + np.arange(tokens), layer, top_k_index, top_k_weights)

    def replayed(self, rows: np.ndarray, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """(index, weights) of trace tokens `rows` (wrapping at the trace's end) at model layer `layer`."""
        chosen = torch.from_numpy(self.choices[rows % len(self.choices), self.layer_pos[layer]])  # (T, k')
        if (chosen < 0).any():
            raise WeightstreamError(
                f"routing trace {self.name!r} has no choice for some token at layer {self.layer_pos[layer]}"
            )
        weights = torch.full(chosen.shape, 1.0 / chosen.shape[1], dtype=top_k_weights.dtype)
        return chosen.to(top_k_index.dtype), weights


class BatchRoutingReplay:
    """Routing override for batched steps (`weightstream serve`): each sequence replays the trace from its own cursor.

    The n-th sequence to start begins at the first token of trace request n mod R and goes on token by token
    (wrapping at the trace's end), so concurrent sequences replay different requests, as different users would,
    and a sequence's routing does not depend on what it is batched with. Also a scheduler hook: `begin_step`
    says which sequences own the step's rows, in row order.
    """

    def __init__(self, trace: Trace, layout: ModelLayout):
        self.replay = RoutingReplay(trace, layout)
        token_start = np.concatenate([[0], np.cumsum(trace.step_tokens)])
        self.request_starts = [int(token_start[trace.first_step_of_request(r)]) for r in range(len(trace.requests))]
        self.cursors: dict[int, int] = {}
        self.started = 0
        self.rows = np.zeros(0, dtype=np.int64)

    def begin_step(self, seq_ids: list[int], tokens: list[int], phase: str) -> None:
        rows = []
        for seq_id, n in zip(seq_ids, tokens):
            if seq_id not in self.cursors:
                self.cursors[seq_id] = self.request_starts[self.started % len(self.request_starts)]
                self.started += 1
            rows.append(self.cursors[seq_id] + np.arange(n))
            self.cursors[seq_id] += n
        self.rows = np.concatenate(rows)

    def end_step(self, seconds: float) -> None:
        pass

    def end_sequence(self, seq_id: int) -> None:
        self.cursors.pop(seq_id, None)

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if len(self.rows) != top_k_index.shape[0]:
            raise RuntimeError(
                f"replay expected {len(self.rows)} tokens this step, the model ran {top_k_index.shape[0]}"
            )
        return self.replay.replayed(self.rows, layer, top_k_index, top_k_weights)


def record_routing(model, tokenizer, prompts: list[str], max_new_tokens: int, name: str) -> Trace:
    """Greedy generation over `prompts` with a loaded streaming model, recording prefill and decode routing."""
    from weightstream.engine.generate import generate

    recorder = RoutingRecorder(model.weightstream.layout, name=name)
    model.weightstream.routing_observer = recorder
    try:
        for i, prompt in enumerate(prompts):
            recorder.request = f"prompt-{i}"
            generate(model, torch.tensor([tokenizer(prompt).input_ids]), max(max_new_tokens, 1))
    finally:
        model.weightstream.routing_observer = None
    return recorder.finish()


def record_trace(
    model_dir: str,
    prompts: list[str],
    max_new_tokens: int,
    out_path: str,
    expert_cache: str = "4x",
    io_threads: int = 4,
) -> Trace:
    """Greedy generation over real prompts with the streaming engine, recording prefill and decode routing."""
    from weightstream.engine.loader import load_streaming_model, load_tokenizer
    from weightstream.trace import save

    tokenizer = load_tokenizer(model_dir, required=True)
    model = load_streaming_model(model_dir, expert_cache=expert_cache, io_threads=io_threads)
    try:
        trace = record_routing(model, tokenizer, prompts, max_new_tokens, model.config.model_type)
    finally:
        model.weightstream.close()
    save(trace, out_path)
    return trace
