"""Quantization quality on a real language model: train a small MoE on real text here, quantize it, compare
held-out perplexity of bf16, int8 and int4 (each group size), all run through weightstream's engine.

Random weights say nothing about quantization error, and no model can be downloaded here, so this trains one:
a qwen3_moe config (4 layers, 8 experts, top-2, about 9M parameters) on the Python standard library's own
sources (real code, comments and docstrings, shipped with every Python), with a byte-level BPE tokenizer trained
on them, for a few minutes of CPU. Files are split by a hash of their name: one in ten is held out. Checkpoints
go outside the repository ($WEIGHTSTREAM_CACHE or ~/.cache/weightstream/small-moe). The model's own routing on
held-out prompts is recorded with the engine (`--trace-out`): the first non-random routing recorded here.

    .venv/bin/python benchmarks/quant_bench.py quality --minutes 8 --trace-out docs/traces/small-moe-stdlib.npz
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch

from common.results import default, save

CACHE = Path(os.environ.get("WEIGHTSTREAM_CACHE") or Path.home() / ".cache" / "weightstream") / "small-moe"
CONFIG = dict(
    model_type="qwen3_moe",
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    vocab_size=4096,
    max_position_embeddings=1024,
    router_aux_loss_coef=0.01,
    output_router_logits=True,
    tie_word_embeddings=False,
)


def corpus() -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the stdlib's .py files, one in ten held out by a hash of its path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts[len(root.parts) :][:1]:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = str(path.relative_to(root))
        (held if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 10 == 0 else train).append(text)
    return train, held


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(out)
    return fast


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    ids = []
    for text in texts:
        ids += tokenizer(text).input_ids + [tokenizer.eos_token_id]
    return torch.tensor(ids)


def train(args, out: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    train_texts, held_texts = corpus()
    tokenizer = train_tokenizer(train_texts, out)
    stream = token_stream(tokenizer, train_texts)
    torch.manual_seed(0)
    fields = dict(CONFIG)
    config = AutoConfig.for_model(
        fields.pop("model_type"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    deadline, steps, losses = time.monotonic() + args.minutes * 60, 0, []
    model.train()
    while time.monotonic() < deadline:
        starts = torch.randint(0, len(stream) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([stream[s : s + args.seq] for s in starts.tolist()])
        lr = args.lr * min(1.0, (steps + 1) / 50)  # short warm-up, then constant: the run is time-boxed
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        steps += 1
    model.eval()
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out)
    return {
        "steps": steps,
        "tokens_seen": steps * args.batch * args.seq,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "train_tokens": len(stream),
        "held_out_files": len(held_texts),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def perplexity(model_dir: str, held: torch.Tensor, seq: int, chunks: int) -> float:
    """exp(mean next-token loss) over `chunks` held-out windows, computed by weightstream's engine."""
    from weightstream.engine.loader import load_streaming_model

    model = load_streaming_model(model_dir, expert_cache="100x", io_threads=2)
    total, count = 0.0, 0
    try:
        with torch.inference_mode():
            for i in range(chunks):
                window = held[i * seq : (i + 1) * seq].unsqueeze(0)
                logits = model(window).logits.float()
                loss = torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:], reduction="sum")
                total, count = total + loss.item(), count + seq - 1
    finally:
        model.weightstream.close()
    return math.exp(total / count)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=8.0, help="training time (default 8)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-chunks", type=int, default=64, help="held-out windows of 256 tokens (default 64)")
    ap.add_argument("--groups", default="32,64,128,256", help="int4 group sizes to compare")
    ap.add_argument("--retrain", action="store_true", help="train again even if a checkpoint exists")
    ap.add_argument("--trace-out", help="record the bf16 model's routing on held-out prompts into this .npz")
    ap.add_argument("--out", default=default("quant-quality.json"), help="result file (default: %(default)s)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from weightstream.store.quantize import quantize_checkpoint

    bf16 = CACHE / "bf16"
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "config": CONFIG,
        "checkpoint": str(bf16).replace(str(Path.home()), "~", 1),
    }
    if args.retrain or not (bf16 / "config.json").exists():
        bf16.mkdir(parents=True, exist_ok=True)
        report["training"] = train(args, bf16)
        (CACHE / "training.json").write_text(json.dumps(report["training"]))
    else:
        report["training"] = json.loads((CACHE / "training.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(bf16)
    held = token_stream(tokenizer, corpus()[1])
    variants = {"bf16": str(bf16)}
    for bits, group in [(8, None)] + [(4, int(g)) for g in args.groups.split(",")]:
        name = f"int{bits}" + (f"-g{group}" if group else "")
        quantize_checkpoint(str(bf16), str(CACHE / name), bits, group, force=True)
        variants[name] = str(CACHE / name)
    report["held_out_tokens"] = args.eval_chunks * 256
    ppl = {name: perplexity(path, held, 256, args.eval_chunks) for name, path in variants.items()}
    report["perplexity"] = ppl
    report["vs_bf16"] = {name: p / ppl["bf16"] - 1 for name, p in ppl.items()}
    if args.trace_out:
        report["trace"] = record(str(bf16), tokenizer, corpus()[1], args.trace_out)
    text = json.dumps(report, indent=1)
    print(text)
    save(text, args.out)


def record(model_dir: str, tokenizer, held_texts: list[str], out: str) -> dict:
    """The model's own routing: greedy generation from the openings of held-out files, prefill and decode."""
    from weightstream.engine.routing import record_trace

    prompts = [tokenizer.decode(tokenizer(text).input_ids[:48]) for text in held_texts[:16]]
    trace = record_trace(model_dir, prompts, 32, out)
    return {"path": out, "requests": len(trace.requests), "tokens": trace.n_tokens, "lookups": trace.n_accesses}
