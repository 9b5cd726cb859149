"""Greedy logits of a streamed model, the way the exactness tests compare configurations."""

from __future__ import annotations

import torch

from weightstream.engine.loader import load_streaming_model


def greedy_run(model_dir: str, prompt: torch.Tensor, max_new_tokens: int = 8, **kwargs):
    """(tokens, per-step logits, runtime) of greedy generation; `expert_cache="100x"` reads every expert into the
    cache before the first token, so nothing streams during it."""
    model = load_streaming_model(model_dir, **kwargs)
    try:
        if kwargs.get("expert_cache") == "100x":
            from weightstream.bench.child import warm_every_expert

            warm_every_expert(model.weightstream.cache)
        with torch.inference_mode():
            out = model.generate(
                prompt, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        return out.sequences[0].tolist(), list(out.logits), model.weightstream
    finally:
        model.weightstream.close()
