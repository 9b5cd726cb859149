"""In-memory speed on the same GGUF file, weightstream against llama.cpp, back to back: a 256-token prompt and
32 decoded tokens, every weight resident on both sides.

Each round runs `llama-bench -m FILE -p 256 -n 32 -d 0,256 -t THREADS -r 1` and, in its own process, weightstream
on the file's import (`weightstream import FILE --out DIR`, every expert read into the cache before timing): the
prefill of a 256-token prompt, then 32 greedy tokens. llama.cpp's decode is its tg test at depth 256 (`-d`: 256
tokens in the context first), since ours decodes after its 256-token prompt; its prompt is the pp test at depth 0.
`--decode-depth 0` compares with llama-bench's default, a decode from an empty context (the figures before
2026-12-05 did, against our decode at positions 256-287). The order alternates between rounds (these machines
drift by 15-25% between runs minutes apart), and the figures are medians with the spread of the rounds; the ratio
of medians is ours / llama.cpp's.

    .venv/bin/python benchmarks/gguf_speed.py FILE.gguf IMPORTED_DIR [--rounds 4] [--threads 2]
        [--out benchmarks/results/gguf-speed-NAME.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp  # noqa: E402
from common.child import json_child  # noqa: E402
from common.results import default, save  # noqa: E402
from common.rounds import alternated  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 256, 32
_OURS = """
import json, sys, time, torch
torch.set_num_threads({threads})
from weightstream.bench.child import warm_every_expert
from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
model = load_streaming_model({model!r}, expert_cache="100x")
warm_every_expert(model.weightstream.cache)
vocab = model.config.get_text_config().vocab_size
prompt = (torch.arange({prompt}) * 7919 + 11).remainder(vocab - 10).add(5).reshape(1, -1)
generate(model, prompt[:, :16], max_new_tokens=4)  # warm-up: the first call's allocations
_, stats = generate(model, prompt, max_new_tokens={new})
out = {{"prompt_tokens_per_s": {prompt} / stats.prefill_s, "decode_tokens_per_s": stats.decode_tokens_per_s}}
print(json.dumps(out))
model.weightstream.close()
"""


def ours(model_dir: str, threads: int) -> dict:
    code = _OURS.format(model=model_dir, threads=threads, prompt=PROMPT_TOKENS, new=NEW_TOKENS)
    return json_child(code, "weightstream run failed", timeout=3600)


def llama(gguf: str, threads: int, repack: bool = True, depth: int = PROMPT_TOKENS) -> dict:
    got = llamacpp.bench(
        gguf,
        threads,
        NEW_TOKENS,
        repeats=1,
        timeout=3600,
        repack=repack,
        prompt_tokens=PROMPT_TOKENS,
        decode_depth=depth,
    )
    if "decode_tokens_per_s" not in got:
        raise SystemExit(f"llama-bench: {got.get('error') or got.get('skipped')}")
    return {key: got[key] for key in ("prompt_tokens_per_s", "decode_tokens_per_s")}


def summary(runs: list[dict]) -> dict:
    out = {}
    for key in ("prompt_tokens_per_s", "decode_tokens_per_s"):
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="llama.cpp's file")
    ap.add_argument("imported", help="`weightstream import` of it")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--repack",
        type=int,
        choices=(0, 1),
        default=1,
        help="llama-bench --repack (default 1, its own; its repacked path asserts on some small MoE files)",
    )
    ap.add_argument(
        "--decode-depth",
        type=int,
        default=PROMPT_TOKENS,
        help=f"tokens in llama.cpp's context before its decode (default {PROMPT_TOKENS}: where ours decodes, after "
        "the prompt; 0: llama-bench's own default, an empty context)",
    )
    ap.add_argument("--out", default=default("gguf-speed.json"))
    args = ap.parse_args()
    sides = {
        "llama.cpp": lambda: llama(args.gguf, args.threads, bool(args.repack), args.decode_depth),
        "weightstream": lambda: ours(args.imported, args.threads),
    }
    runs = alternated(
        args.rounds,
        sides,
        lambda r, who, got: print(f"[gguf-speed] round {r} {who}: {got}", file=sys.stderr, flush=True),
    )
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gguf": os.path.basename(args.gguf),
        "gguf_bytes": os.path.getsize(args.gguf),
        "threads": args.threads,
        "llama_repack": bool(args.repack),
        "llama_decode_depth": args.decode_depth,
        "rounds": args.rounds,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "llama.cpp": summary(runs["llama.cpp"]),
        "weightstream": summary(runs["weightstream"]),
    }
    report["ratio"] = {
        key: report["weightstream"][key]["median"] / report["llama.cpp"][key]["median"]
        for key in ("prompt_tokens_per_s", "decode_tokens_per_s")
    }
    report["ratio_per_round"] = {
        key: [o[key] / t[key] for o, t in zip(runs["weightstream"], runs["llama.cpp"], strict=True)]
        for key in ("prompt_tokens_per_s", "decode_tokens_per_s")
    }
    text = json.dumps(report, indent=1)
    print(text)
    save(text, args.out)


if __name__ == "__main__":
    main()
