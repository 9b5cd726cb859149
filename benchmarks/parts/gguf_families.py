"""The MoE families that need streaming, from the files their users have: each family's small synthetic checkpoint
converted by llama.cpp's own converter and quantized by its own `llama-quantize`, then `weightstream import`ed and
checked (issue 36's proof, with llama.cpp's tools; tests/ hold the same checks on files written here).

For each family (DeepSeek-V2 with a plain q and softmax routing, DeepSeek-V3 with q_lora, sigmoid routing, its
correction bias, expert groups and YaRN, GLM-4.5 with partial rotary, shared experts and leading dense layers,
gpt-oss with MXFP4 experts, biases, sinks and sliding windows) and each type (Q8_0, Q4_K_M, Q3_K_M, Q2_K; gpt-oss
also MXFP4_MOE):
- import: what was kept as blocks, requantized or dequantized (the importer's notes), or why it was refused;
- `blocks_equal`: every expert blob tensor is the file's bytes (gate rows then up rows, as GGUF stores them);
- `streamed_equal_resident`: greedy tokens and logits at 1x, 1.5x and 4x expert caches with 1 and 8 I/O threads
  equal those of every expert resident, bitwise;
- `reference`: the same weights dequantized (gguf's decoding, which the kernels' dequantize equals bitwise) in
  transformers' own model, float32: the prefill logits (dequantized products on both sides) and the decoded
  tokens' logits (8-bit activations against the blocks), the reference fed the engine's own tokens, as relative
  differences, and how often the two pick the same next token.

    .venv/bin/python benchmarks/gguf_import.py families [--families deepseek_v2,gpt_oss] [--types Q4_K_M,Q2_K]
        [--work .work/gguf-families] [--out benchmarks/results/gguf-families.json]

Needs llama.cpp built (benchmarks/llamacpp.py build: about 20 minutes, once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import llamacpp
import numpy as np
import torch

from weightstream.store.presets import preset_config

SMALL = dict(hidden_size=256, vocab_size=512, num_attention_heads=4, max_position_embeddings=4096)
MLA = dict(kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, head_dim=32)
FAMILIES = {
    "deepseek_v2": dict(  # llama.cpp takes a plain q (no q_lora_rank) only from V2-Lite's 27 layers
        **MLA, moe_intermediate_size=256, intermediate_size=512, scoring_func="softmax", num_hidden_layers=27
    ),
    "deepseek_v3": dict(
        **MLA,
        moe_intermediate_size=256,
        intermediate_size=512,
        q_lora_rank=256,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    "glm4_moe": dict(moe_intermediate_size=256, intermediate_size=512, head_dim=64, partial_rotary_factor=0.5),
    "gpt_oss": dict(intermediate_size=256, head_dim=64, num_key_value_heads=2, sliding_window=8),
}
TYPES = ("Q8_0", "Q4_K_M", "Q3_K_M", "Q2_K")
EXTRA_TYPES = {"gpt_oss": ("MXFP4_MOE",)}
PROMPT = (torch.arange(24) * 37 + 3).remainder(500).reshape(1, -1)  # a prefill of 24 rows: dequantized products
CACHES = ("1x", "1.5x", "4x")
THREADS = (1, 8)
NEW_TOKENS = 8


def source(family: str, work: str) -> str:
    """The family's small synthetic bf16 checkpoint (built once)."""
    from weightstream.store.synth import synthesize

    out = os.path.join(work, family)
    if not os.path.exists(os.path.join(out, "config.json")):
        cfg = {**preset_config("tiny", family), **SMALL, **FAMILIES[family], "tie_word_embeddings": False}
        cfg.pop("architectures", None)
        synthesize(out, cfg, dtype="bf16", seed=1)
    return out


def greedy(model_dir: str, **kwargs) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """(tokens, decode logits, prefill logits) of the imported model streamed with these settings."""
    from weightstream.engine.loader import load_streaming_model

    model = load_streaming_model(model_dir, **kwargs)
    try:
        with torch.inference_mode():
            prefill = model(PROMPT).logits[0].float()
            out = model.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        return out.sequences[0].tolist(), [g[0].float() for g in out.logits], prefill
    finally:
        model.weightstream.close()


def blocks_equal(gguf: str, out: str) -> dict:
    """Every expert blob tensor against the file's slice: (checked, differing) tensors."""
    from gguf import GGUFReader

    from weightstream.store.checkpoint import open_checkpoint
    from weightstream.store.quant.manifest import read_manifest

    fmt, ckpt = read_manifest(out), open_checkpoint(out)
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    interleaved = json.load(open(os.path.join(out, "config.json")))["model_type"] == "gpt_oss"
    checked = differing = 0
    for key, info in ckpt.tensors.items():
        if not key.endswith(".packed"):
            continue
        path, expert = key[: -len(".packed")].rsplit(".", 1)
        layer = int(path.split(".layers.")[1].split(".")[0])
        with open(info.path, "rb") as f:
            f.seek(info.offset)
            blob = np.frombuffer(f.read(info.nbytes), dtype=np.uint8)
        for t in fmt.table(layer)[0]:
            if not t.name.endswith(".qweight"):
                continue
            got = blob[t.offset : t.offset + t.nbytes].reshape(t.shape[0], -1)
            if t.name.startswith("gate_up"):
                gate = np.asarray(tensors[f"blk.{layer}.ffn_gate_exps.weight"].data[int(expert)])
                up = np.asarray(tensors[f"blk.{layer}.ffn_up_exps.weight"].data[int(expert)])
                want = (
                    np.stack([gate, up], 1).reshape(-1, gate.shape[-1]) if interleaved else np.concatenate([gate, up])
                )
            else:
                want = np.asarray(tensors[f"blk.{layer}.ffn_down_exps.weight"].data[int(expert)])
            checked += 1
            differing += int(not np.array_equal(got, want.reshape(got.shape[0], -1).view(np.uint8)))
    return {"tensors": checked, "differing": differing}


def reference_model(out: str) -> torch.nn.Module:
    """transformers' model of the imported config, float32, every weight the imported one dequantized."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightstream import native
    from weightstream.store.checkpoint import open_checkpoint
    from weightstream.store.quant.manifest import read_manifest

    def read_tensor(key: str) -> torch.Tensor:
        with safe_open(ckpt.tensors[key].path, "pt") as f:
            return f.get_tensor(key)

    fmt, ckpt = read_manifest(out), open_checkpoint(out)
    config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for key in ckpt.tensors:
        if key.endswith(".packed"):
            continue
        value = read_tensor(key)
        if fmt.dense and key in fmt.dense:
            wtype, (n, k) = fmt.dense[key]
            value = native.dequantize(value.reshape(-1).contiguous(), wtype, n, k)
        state[key] = value.float()
    for path, module in ((p, m) for p, m in model.named_modules() if hasattr(m, "gate_up_proj")):
        layer = int(path.split(".layers.")[1].split(".")[0])
        table = {t.name: t for t in fmt.table(layer)[0]}
        for e in range(module.gate_up_proj.shape[0]):
            blob = read_tensor(f"{path}.{e}.packed").reshape(-1)
            for name in ("gate_up_proj", "down_proj"):
                t = table[f"{name}.qweight"]
                raw = blob[t.offset : t.offset + t.nbytes].contiguous()
                w = native.dequantize(raw, t.dtype, *t.shape)  # (out, in)
                state[f"{path}.{name}"] = state.get(f"{path}.{name}", getattr(module, name).detach().clone())
                state[f"{path}.{name}"][e] = w.t() if module.is_transposed else w
                if f"{name}_bias" in table:
                    b = table[f"{name}_bias"]
                    bias = blob[b.offset : b.offset + b.nbytes].view(getattr(torch, b.dtype))
                    key = f"{path}.{name}_bias"
                    state[key] = state.get(key, getattr(module, f"{name}_bias").detach().clone())
                    state[key][e] = bias.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise SystemExit(f"reference model of {out}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.eval()


def against_reference(out: str, resident) -> dict:
    """The engine's prefill and decode logits against the reference model's on the same tokens (the engine's own
    sequence, teacher-forced: a near-tied token chosen differently does not make the later steps incomparable)."""
    model = reference_model(out)
    tokens, logits, prefill = resident
    n = PROMPT.shape[1]
    with torch.inference_mode():
        want_prefill = model(PROMPT).logits[0].float()
        forced = model(torch.tensor([tokens[:-1]])).logits[0, n - 1 :].float()  # the logits each new token came from
    rel = lambda got, want: float((got - want).abs().max() / want.abs().max())  # noqa: E731
    steps = [rel(g.float(), w) for g, w in zip(logits, forced, strict=True)]
    return {
        "prefill_logits_rel_diff": rel(prefill, want_prefill),
        "prefill_argmax_agreement": float((prefill.argmax(-1) == want_prefill.argmax(-1)).float().mean()),
        "decode_logits_rel_diff_max": max(steps),
        "decode_logits_rel_diff_median": float(np.median(steps)),
        "decode_argmax_agreement": sum(int(w.argmax()) == t for w, t in zip(forced, tokens[n:], strict=True))
        / NEW_TOKENS,
    }


def run_one(family: str, qtype: str, work: str) -> dict:
    from weightstream.store.gguf_import import import_gguf

    row: dict = {"family": family, "type": qtype}
    src = source(family, work)
    bf16 = llamacpp.convert(src, os.path.join(work, f"{family}-bf16.gguf"), "bf16", "default")
    gguf = llamacpp.quantize(bf16, os.path.join(work, f"{family}-{qtype}.gguf"), qtype)
    out = os.path.join(work, f"{family}-{qtype}")
    notes: list[str] = []
    start = time.perf_counter()
    try:
        result = import_gguf(gguf, out, log=notes.append, force=True)
    except Exception as exc:  # the refusal is the result
        row["import"] = {"refused": f"{type(exc).__name__}: {exc}"}
        return row
    row["import"] = {
        "seconds": round(time.perf_counter() - start, 2),
        "expert_types": getattr(result, "expert_types", None),
        "dense_blocks": getattr(result, "dense_blocks", None),
        "requantized": getattr(result, "requantized", None),
        "notes": notes,
    }
    row["blocks_equal"] = blocks_equal(gguf, out)
    resident = greedy(out, expert_cache="100x")
    same = {}
    for cache in CACHES:
        for threads in THREADS:
            tokens, logits, _ = greedy(out, expert_cache=cache, io_threads=threads)
            same[f"{cache}/{threads}"] = tokens == resident[0] and all(
                torch.equal(a, b) for a, b in zip(logits, resident[1], strict=True)
            )
    row["streamed_equal_resident"] = same
    row["reference"] = against_reference(out, resident)
    return row


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--types", default=",".join(TYPES), help="llama-quantize types (gpt-oss also gets MXFP4_MOE)")
    ap.add_argument("--work", default=".work/gguf-families")
    ap.add_argument("--out", default="benchmarks/results/gguf-families.json")
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    rows = []
    for family in args.families.split(","):
        for qtype in (*args.types.split(","), *EXTRA_TYPES.get(family, ())):
            try:
                row = run_one(family, qtype, args.work)
            except Exception as exc:
                row = {"family": family, "type": qtype, "error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            print(json.dumps(row), flush=True)
            rows.append(row)
    report = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
