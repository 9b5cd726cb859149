"""Greedy logits of a streamed model and of transformers' own, the way the exactness tests compare them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from weightstream.engine.loader import load_streaming_model

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])
NEW_TOKENS = 12


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# transformers' own form of DeepSeek's latent attention, the one these tests hold bitwise to its model; the engine's
# default absorbed form is held to it within rounding, and streamed to resident bitwise, in test_latent_attention.py
EXPANDED = {"latent_attention": "expanded"}


def greedy_logits(model) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits of every step (prefill's last position, then each decode step)."""
    with torch.inference_mode():
        out = model.generate(
            PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    return out.sequences[0, PROMPT.shape[1] :].tolist(), list(out.logits)


def reference(model_dir, dtype="fp32"):
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], experts_implementation="eager")
    return greedy_logits(ref)


def reference_tokens(model_dir):
    return reference(model_dir)[0]


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
