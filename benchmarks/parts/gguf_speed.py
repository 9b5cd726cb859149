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

    .venv/bin/python benchmarks/llamacpp.py speed FILE.gguf IMPORTED_DIR [--rounds 4] [--threads 2]
        [--prompt-tokens 4096] [--out benchmarks/results/gguf-speed-NAME.json]

`--depths 256,1024,4096` measures at those context depths instead (issue 50: decode that does not fall with the
context): llama.cpp's `llama-bench -p 256 -n 16 -d DEPTHS` (its pp and tg tests at each depth), ours in one process
per round: DEPTH tokens prefilled (512 a forward), then 16 greedy tokens timed one forward each (decode at depth
DEPTH), then one forward of a 256-token prompt (at depth DEPTH + 16). Each forward computes the output head for its
last row only, as `generate` does and as llama-bench's pp test does (a batch without a logits array outputs its last
token); before 2026-12-06 20:30 ours computed it for all 256 rows, which understated our prompts at depth.
`--latent-attention absorbed,expanded` times each form of DeepSeek's latent attention as a side of its own
(expanded: transformers', the form before issue 50); `--kv-dtype auto,float16` each dtype of its latent cache
(float16: as llama.cpp's default KV cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import llamacpp
from common.child import json_child
from common.results import default, emit
from common.rounds import alternated, head

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


def ours(model_dir: str, threads: int, prompt: int = PROMPT_TOKENS) -> dict:
    code = _OURS.format(model=model_dir, threads=threads, prompt=prompt, new=NEW_TOKENS)
    return json_child(code, "weightstream run failed", timeout=3600)


DEPTH_PROMPT, DEPTH_NEW = 256, 16
_OURS_AT_DEPTHS = """
import json, time, torch
torch.set_num_threads({threads})
from weightstream.bench.child import warm_every_expert
from weightstream.engine.kv_cache import engine_cache, quiet_cache_kwarg
from weightstream.engine.loader import load_streaming_model
model = load_streaming_model({model!r}, expert_cache="100x", latent_attention={form!r}, kv_dtype={kv!r})
warm_every_expert(model.weightstream.cache)
vocab = model.config.get_text_config().vocab_size
depths, prompt, new = {depths!r}, {prompt}, {new}
ids = (torch.arange(max(depths) + new + prompt) * 7919 + 11).remainder(vocab - 10).add(5).reshape(1, -1)

def last(chunk, cache):  # the last row's logits only, as generate and llama-bench's pp compute them
    return model(chunk, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

out = {{}}
with torch.inference_mode(), quiet_cache_kwarg():
    warm = engine_cache(model, 32)  # warm-up as llama-bench's, a prompt and then one decode row: the first calls'
    last(ids[:, :16], warm)  # allocations and one-time checks, on both paths
    last(ids[:, 16:17], warm)
    for depth in depths:
        cache = engine_cache(model, depth + new + prompt)
        for start in range(0, depth, 512):
            logits = last(ids[:, start : min(depth, start + 512)], cache)
        token = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(new):
            token = last(token, cache).argmax(-1, keepdim=True)
        decode = new / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        last(ids[:, depth : depth + prompt], cache)
        out[str(depth)] = {{"decode_tokens_per_s": decode, "prompt_tokens_per_s": prompt / (time.perf_counter() - t0)}}
print(json.dumps(out))
model.weightstream.close()
"""


def ours_at_depths(model_dir: str, threads: int, depths: list[int], form: str, kv: str = "auto") -> dict:
    code = _OURS_AT_DEPTHS.format(
        model=model_dir, threads=threads, depths=depths, prompt=DEPTH_PROMPT, new=DEPTH_NEW, form=form, kv=kv
    )
    return json_child(code, "weightstream run failed", timeout=3600)


def llama_at_depths(gguf: str, threads: int, repack: bool, depths: list[int]) -> dict:
    """llama-bench's pp (a 256-token prompt) and tg (16 tokens) at each depth, one run of each."""
    bin_dir = llamacpp.build()
    if bin_dir is None:
        raise SystemExit("llama.cpp is not built here (no compiler or cmake)")
    argv = llamacpp.bench_argv(bin_dir, gguf, DEPTH_PROMPT, DEPTH_NEW, threads, 1, repack)
    argv += ["-d", ",".join(map(str, depths))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench exit {done.returncode}: {done.stderr.strip()[-500:]}")
    out: dict = {str(d): {} for d in depths}
    for row in json.loads(done.stdout):
        key = "decode_tokens_per_s" if row.get("n_gen") else "prompt_tokens_per_s"
        out[str(row.get("n_depth", 0))][key] = row["avg_ts"]
    return out


def depth_report(runs: dict, depths: list[int]) -> dict:
    """Per depth and figure: each side's median, min, max and runs; each form's ratio to llama.cpp's medians."""
    keys = ("decode_tokens_per_s", "prompt_tokens_per_s")
    out: dict = {}
    for depth in map(str, depths):
        sides = {who: summary([r[depth] for r in rs]) for who, rs in runs.items()}
        ratios = {
            who: {
                key: {
                    "median": sides[who][key]["median"] / sides["llama.cpp"][key]["median"],
                    "per_round": [o[depth][key] / t[depth][key] for o, t in zip(rs, runs["llama.cpp"], strict=True)],
                }
                for key in keys
            }
            for who, rs in runs.items()
            if who != "llama.cpp"
        }
        out[depth] = {"sides": sides, "ratio": ratios}
    return out


def llama(
    gguf: str, threads: int, repack: bool = True, depth: int = PROMPT_TOKENS, prompt: int = PROMPT_TOKENS
) -> dict:
    got = llamacpp.bench(
        gguf,
        threads,
        NEW_TOKENS,
        repeats=1,
        timeout=3600,
        repack=repack,
        prompt_tokens=prompt,
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


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        "--prompt-tokens",
        type=int,
        default=PROMPT_TOKENS,
        help=f"the prompt's length on both sides (default {PROMPT_TOKENS}; ours prefills it in one forward, "
        "llama-bench -p N)",
    )
    ap.add_argument(
        "--decode-depth",
        type=int,
        help="tokens in llama.cpp's context before its decode (default: the prompt's length, where ours decodes; 0: "
        "llama-bench's own default, an empty context)",
    )
    ap.add_argument("--depths", help="context depths to measure at, e.g. 256,1024,4096 (see above)")
    ap.add_argument(
        "--latent-attention",
        default="absorbed",
        help="with --depths: the forms of DeepSeek's latent attention to time, each a side (absorbed,expanded)",
    )
    ap.add_argument(
        "--kv-dtype",
        default="auto",
        help="with --depths, on a DeepSeek model: the dtypes of our latent cache to time, each a side of the absorbed "
        "form (auto,float16; llama.cpp keeps its default f16 cache)",
    )
    ap.add_argument("--out", default=default("gguf-speed.json"))
    args = ap.parse_args(argv)
    if args.depths:
        return at_depths(args)
    depth = args.prompt_tokens if args.decode_depth is None else args.decode_depth
    sides = {
        "llama.cpp": lambda: llama(args.gguf, args.threads, bool(args.repack), depth, args.prompt_tokens),
        "weightstream": lambda: ours(args.imported, args.threads, args.prompt_tokens),
    }
    runs, report = run_rounds(args, sides)
    report |= {
        "llama_decode_depth": depth,
        "prompt_tokens": args.prompt_tokens,
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
    emit(report, args.out)


def run_rounds(args, sides: dict) -> tuple[dict, dict]:
    """Each side's runs, alternated over --rounds, and the report's common head (date, file, threads, rounds)."""
    runs = alternated(
        args.rounds,
        sides,
        lambda r, who, got: print(f"[gguf-speed] round {r} {who}: {got}", file=sys.stderr, flush=True),
    )
    report = head(
        args.gguf,
        gguf_bytes=os.path.getsize(args.gguf),
        threads=args.threads,
        llama_repack=bool(args.repack),
        rounds=args.rounds,
    )
    return runs, report


def at_depths(args) -> None:
    depths = sorted({int(d) for d in args.depths.split(",")})
    sides = {"llama.cpp": lambda: llama_at_depths(args.gguf, args.threads, bool(args.repack), depths)}
    with open(os.path.join(args.imported, "config.json")) as f:
        latent = "kv_lora_rank" in json.load(f)  # DeepSeek's latent attention: each form its own side, named
    for form in args.latent_attention.split(",") if latent else ["absorbed"]:
        for kv in args.kv_dtype.split(",") if latent and form == "absorbed" else ["auto"]:
            name = (f"weightstream {form}" if latent else "weightstream") + ("" if kv == "auto" else f" kv {kv}")
            sides[name] = lambda form=form, kv=kv: ours_at_depths(args.imported, args.threads, depths, form, kv)
    runs, report = run_rounds(args, sides)
    report |= {
        "prompt_tokens": DEPTH_PROMPT,
        "new_tokens": DEPTH_NEW,
        "depths": depth_report(runs, depths),
    }
    emit(report, args.out)
