"""Quantization quality on a real language model: train a small MoE on real text here, quantize it, compare
held-out perplexity of bf16 and its quantized variants, all run through weightstream's engine.

Random weights say nothing about quantization error, and no model can be downloaded here, so this trains one:
a small MoE (4 layers, 8 experts, top-2, hidden 256, experts' intermediate 256, about 9M parameters) of one of
four architectures (`--arch`: qwen3_moe, the default, olmoe, deepseek_v3 or gpt_oss; CONFIGS says how each is
shaped) on the Python standard library's own sources (real code, comments and docstrings, shipped with every
Python), with a byte-level BPE tokenizer trained on them, for a few minutes of CPU. Files are split by a hash of
their name: one in ten is held out. Checkpoints go outside the repository, one directory per architecture
($WEIGHTSTREAM_CACHE or ~/.cache/weightstream, then small-moe for qwen3_moe, small-moe-ARCH for the others). Every
weight shape is whole super-blocks of 256, so K-quants fit.

Variants (`weightstream quantize` of the bf16 checkpoint): experts only, `int8` (--bits 8: Q8_0) and `int4`
(--bits 4: Q4_K); experts and dense weights (attention, output head; router, norms and embeddings kept),
`int8+dense-int8` (--bits 8 --dense int8) and `int4+dense-int4` (--bits 4 --dense int4); `int4+dense-int8`
beside them; and torch's int4 at each group size of `--groups` (--kernel torch). The model's own routing on
held-out prompts can be recorded with the engine (`--trace-out`).

    .venv/bin/python benchmarks/quant_bench.py quality --minutes 8 --trace-out docs/traces/small-moe-stdlib.npz
    .venv/bin/python benchmarks/quant_bench.py quality --arch olmoe --minutes 8

Training is time-boxed by default (`--minutes`), so the model depends on the machine's load: 8 minutes made 1116
steps on an idle 2-core machine, 67 on one that other jobs loaded. `--steps N` trains N steps however long they
take, and `--threads 1` is several times faster than torch's default of one thread a core when other jobs share
the cores (2.1 against 13 s a step here). The result files in benchmarks/results/ were made so:

    .venv/bin/python benchmarks/quant_bench.py quality --steps 1116 --threads 1 --retrain --attribute
    .venv/bin/python benchmarks/quant_bench.py quality --arch olmoe --steps 1116 --threads 1 --retrain --attribute
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

ROOT = Path(os.environ.get("WEIGHTSTREAM_CACHE") or Path.home() / ".cache" / "weightstream")
CACHE = ROOT / "small-moe"  # the qwen3_moe model's (`gguf_import.py quality` uses it too)
_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    vocab_size=4096,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
_COMMON = dict(
    **_SHAPE,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.01,
    output_router_logits=True,
)
CONFIGS = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        **_COMMON,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_key_value_heads=2,
        norm_topk_prob=True,
    ),
    # OLMoE: q/k norms over the whole projection, no renormalized top-k, full multi-head attention (as OLMoE-1B-7B)
    "olmoe": dict(model_type="olmoe", **_COMMON, intermediate_size=256, num_key_value_heads=4, norm_topk_prob=False),
    # DeepSeek-V3 in small: multi-head latent attention with q_lora, the first layer dense, one shared expert, sigmoid
    # routing in 2 groups (1 chosen) with its correction bias (trained as V3's is, see `balance`), top-k renormalized
    # and scaled by 2.5, YaRN as V3 has it (mscale = mscale_all_dim = 1). Every projection's input is 256 wide (the
    # LoRA ranks too) so K-quants fit. `scoring_func` is not DeepseekV3Config's: llama.cpp's converter reads it to
    # write expert_gating_func (sigmoid), which the import needs to pick DeepseekV3.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        **_SHAPE,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=256,
        intermediate_size=512,
        first_k_dense_replace=1,
        q_lora_rank=256,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        head_dim=32,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # gpt-oss in small: 4 heads of 64 over 2 key/value heads, attention biases and sinks, sliding-window layers (64
    # tokens, so in 256-token windows the alternation matters) between full ones, expert biases and the clamped
    # SwiGLU, rope as gpt-oss's (transformers' default: YaRN x32 of 4096, theta 150000)
    "gpt_oss": dict(
        model_type="gpt_oss",
        **(_SHAPE | {"max_position_embeddings": 131072}),  # 32 x 4096, as YaRN's factor says (transformers warns else)
        head_dim=64,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=256,
        sliding_window=64,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
    ),
}
CONFIG = CONFIGS["qwen3_moe"]
# name -> quantize_checkpoint keywords; the torch int4 group sizes of --groups are added to these
VARIANTS = {
    "int8": dict(bits=8),
    "int4": dict(bits=4),
    "int8+dense-int8": dict(bits=8, dense="int8"),
    "int4+dense-int8": dict(bits=4, dense="int8"),
    "int4+dense-int4": dict(bits=4, dense="int4"),
}


def cache_dir(arch: str) -> Path:
    """Where the model of `arch` is trained and quantized: small-moe (qwen3_moe), small-moe-ARCH otherwise."""
    return CACHE if arch == "qwen3_moe" else ROOT / f"small-moe-{arch}"


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


def train_tokenizer(texts: list[str], out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
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


def train(args, out: Path, config_fields: dict = CONFIG) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    train_texts, held_texts = corpus()
    tokenizer = train_tokenizer(train_texts, out, config_fields["vocab_size"])
    stream = token_stream(tokenizer, train_texts)
    torch.manual_seed(0)
    fields = dict(config_fields)
    config = AutoConfig.for_model(
        fields.pop("model_type"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager")
    loads = balance(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    start = time.monotonic()
    deadline, steps, losses = start + args.minutes * 60, 0, []
    model.train()
    while (steps < args.steps) if args.steps else (time.monotonic() < deadline):
        starts = torch.randint(0, len(stream) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([stream[s : s + args.seq] for s in starts.tolist()])
        lr = args.lr * min(1.0, (steps + 1) / 50)  # short warm-up, then constant
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if loads is not None:
            loads.update()
        losses.append(loss.item())
        steps += 1
    model.eval()
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out)
    return {
        "budget": f"{args.steps} steps" if args.steps else f"{args.minutes:g} minutes",
        "threads": torch.get_num_threads(),
        "seconds": time.monotonic() - start,
        "steps": steps,
        "tokens_seen": steps * args.batch * args.seq,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "train_tokens": len(stream),
        "held_out_files": len(held_texts),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


class balance:
    """DeepSeek-V3's auxiliary-loss-free balancing (its paper, section 2.1.2): after each step, each layer's routing
    bias (`e_score_correction_bias`, added to the sigmoid scores only to choose experts) rises by `speed` for each
    expert chosen less than the mean and falls by it for each chosen more. transformers trains no bias (it has no
    balancing for DeepseekV3), and a bias left at zero would leave the import's handling of it untested. A model
    without such biases is left alone (the call returns None)."""

    def __new__(cls, model, speed: float = 1e-3):
        routers = [m for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)]
        if not routers:
            return None
        self = super().__new__(cls)
        self.speed, self.counts = speed, {}
        for router in routers:
            router.register_forward_hook(self._count)
        return self

    def _count(self, router, _inputs, output) -> None:
        chosen = output[-1].reshape(-1)  # (router_logits, weights, indices)
        n = router.e_score_correction_bias.numel()
        self.counts[router] = self.counts.get(router, 0) + torch.bincount(chosen, minlength=n)

    def update(self) -> None:
        with torch.no_grad():
            for router, load in self.counts.items():
                load = load.float()
                router.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)
        self.counts = {}


def perplexity(model_dir: str, windows: torch.Tensor, first: int = 0, kv_dtype: str = "auto") -> float:
    """exp(mean next-token loss) over held-out windows (n, seq), each scored from position `first` on (0: every
    prediction; llama-perplexity scores the second half), computed by weightstream's engine (on its own cache, as
    `generate` runs it, its latent stored in `kv_dtype`)."""
    from weightstream.engine.kv_cache import engine_cache, quiet_cache_kwarg
    from weightstream.engine.loader import load_streaming_model

    model = load_streaming_model(model_dir, expert_cache="100x", io_threads=2, kv_dtype=kv_dtype)
    total, count = 0.0, 0
    try:
        with torch.inference_mode(), quiet_cache_kwarg():
            for w in windows:
                cache = engine_cache(model, len(w))
                logits = model(w.unsqueeze(0), past_key_values=cache, use_cache=True).logits[0].double()
                loss = torch.nn.functional.cross_entropy(logits[first:-1], w[first + 1 :], reduction="sum")
                total, count = total + loss.item(), count + len(w) - 1 - first
    finally:
        model.weightstream.close()
    return math.exp(total / count)


# the issue's targets for dense weights quantized: held-out perplexity within this much of bf16's
TARGETS = {"int8+dense-int8": 0.005, "int4+dense-int4": 0.03}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(CONFIGS), default="qwen3_moe", help="architecture (default qwen3_moe)")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time (default 8)")
    ap.add_argument(
        "--steps",
        type=int,
        help="train this many steps instead, however long they take (the same model on a loaded machine)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's, one a core); on a machine others load, 1 trains several times faster",
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-chunks", type=int, default=64, help="held-out windows of 256 tokens (default 64)")
    ap.add_argument("--groups", default="32,64,128,256", help="torch int4 group sizes to compare ('' for none)")
    ap.add_argument(
        "--attribute",
        action="store_true",
        help="also int4 experts with one kind of dense weight at a time quantized to int4 (which tensor costs what)",
    )
    ap.add_argument("--retrain", action="store_true", help="train again even if a checkpoint exists")
    ap.add_argument("--trace-out", help="record the bf16 model's routing on held-out prompts into this .npz")
    ap.add_argument(
        "--out",
        help="result file (default: benchmarks/results/quant-quality-small-moe.json for qwen3_moe, "
        "quant-quality-small-ARCH.json otherwise)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    cache = cache_dir(args.arch)
    out = args.out or default(
        "quant-quality-small-moe.json" if args.arch == "qwen3_moe" else f"quant-quality-small-{args.arch}.json"
    )
    bf16 = cache / "bf16"
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "arch": args.arch,
        "config": CONFIGS[args.arch],
        "checkpoint": str(bf16).replace(str(Path.home()), "~", 1),
    }
    if args.retrain or not (bf16 / "config.json").exists():
        bf16.mkdir(parents=True, exist_ok=True)
        report["training"] = train(args, bf16, CONFIGS[args.arch])
        (cache / "training.json").write_text(json.dumps(report["training"]))
    else:
        report["training"] = json.loads((cache / "training.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(bf16)
    held = token_stream(tokenizer, corpus()[1])
    variants = {"bf16": str(bf16)}
    plans = dict(VARIANTS) | {f"int4-g{g}": dict(bits=4, group_size=int(g)) for g in args.groups.split(",") if g}
    if args.attribute:
        plans |= {f"int4+dense-int4:{k}": dict(bits=4, dense="int4", only=k) for k in dense_kinds(str(bf16))}
    for name, kw in plans.items():
        variants[name] = quantized(str(bf16), str(cache / name.replace("+", "_").replace(":", "_")), **kw)
    report["formats"] = {name: describe(path) for name, path in variants.items()}
    report["held_out_tokens"] = args.eval_chunks * 256
    windows = held[: args.eval_chunks * 256].reshape(args.eval_chunks, 256)
    ppl = {name: perplexity(path, windows) for name, path in variants.items()}
    report["perplexity"] = ppl
    report["vs_bf16"] = {name: p / ppl["bf16"] - 1 for name, p in ppl.items()}
    report["targets"] = {
        name: {"within": t, "vs_bf16": report["vs_bf16"][name], "met": abs(report["vs_bf16"][name]) <= t}
        for name, t in TARGETS.items()
    }
    if args.trace_out:
        report["trace"] = record(str(bf16), tokenizer, corpus()[1], args.trace_out)
    text = json.dumps(report, indent=1)
    print(text)
    save(text, out)


def quantized(src: str, out: str, bits: int, group_size: int | None = None, dense: str = "keep", only=None) -> str:
    """`weightstream quantize SRC --bits BITS [--group-size G] [--dense DENSE]` into `out`; with `only`, just the
    dense weights whose name ends in `only.weight` are quantized (the rest kept), to see what each kind costs."""
    from weightstream.store.quant import pipeline as quantize

    kernel = "torch" if group_size else "auto"
    if only is None:
        quantize.quantize_checkpoint(src, out, bits, group_size, force=True, kernel=kernel, dense=dense)
        return out
    plan = quantize.dense_plan
    quantize.dense_plan = lambda mapped, b: {k: v for k, v in plan(mapped, b).items() if k.endswith(f"{only}.weight")}
    try:
        quantize.quantize_checkpoint(src, out, bits, group_size, force=True, kernel=kernel, dense=dense)
    finally:
        quantize.dense_plan = plan
    return out


def dense_kinds(model_dir: str) -> list[str]:
    """The kinds of dense weight --dense quantizes (q_proj, ..., lm_head): the last part of each module's name."""
    from weightstream.store.model import map_model
    from weightstream.store.quant.plan import dense_plan

    return sorted({k.removesuffix(".weight").rpartition(".")[2] for k in dense_plan(map_model(model_dir), "int4")})


def describe(model_dir: str) -> dict:
    """The experts' scheme and how many dense tensors are stored in each block type (from the manifest)."""
    from collections import Counter

    from weightstream.store.model import map_model

    quant = map_model(model_dir).quant
    if quant is None:
        return {"experts": "bf16", "dense": {}}
    return {
        "experts": quant.scheme + (f"-g{quant.group_size}" if quant.scheme == "int4" else ""),
        "dense": dict(Counter(t for t, _ in (quant.dense or {}).values())),
    }


def record(model_dir: str, tokenizer, held_texts: list[str], out: str) -> dict:
    """The model's own routing: greedy generation from the openings of held-out files, prefill and decode."""
    from weightstream.engine.routing import record_trace

    prompts = [tokenizer.decode(tokenizer(text).input_ids[:48]) for text in held_texts[:16]]
    trace = record_trace(model_dir, prompts, 32, out)
    return {"path": out, "requests": len(trace.requests), "tokens": trace.n_tokens, "lookups": trace.n_accesses}
