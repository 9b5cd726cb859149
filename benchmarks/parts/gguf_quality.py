"""GGUF import against llama.cpp on the same files: held-out perplexity and greedy tokens.

The small qwen3_moe trained here on the Python standard library (parts/quant_quality.py, the quality model of the
quantized experts; `--arch` takes another of its architectures, e.g. deepseek_v3 or gpt_oss, trained the same way)
is converted by llama.cpp's own converter (bf16 GGUF, the pre-tokenizer named "gpt-2", which is how llama.cpp
knows our GPT-2 style ByteLevel BPE) and quantized by llama-quantize to each of --types (gpt_oss also MXFP4_MOE,
the type its release's experts come in). Each GGUF is then

1. scored by `llama-perplexity -m X.gguf -f held.txt -c 256 -b 256 -t 2 --chunks N --no-escape` (without
   --no-escape llama.cpp turns the text's backslash sequences, \\n, \\', ..., into the characters they name before
   tokenizing: a Python source is then not the file's text). The text is tokenized once (a BOS first where the
   file's tokenizer.ggml.add_bos_token says so), cut into N windows of 256 tokens, the first token of each window
   replaced by BOS where BOS is added, and only the second half of each window scored (the logits of positions
   128..254 against tokens 129..255: 127 per window);
2. imported by `weightstream import X.gguf --out DIR` (the CLI, as users run it) and scored by weightstream's
   engine on the same token ids with the same windows, the same BOS and the same scored positions. The token ids
   are llama-tokenize's of the same file, checked equal to our tokenizer's (BOS aside) before anything is scored;
3. run greedily from 8 prompts (the first --prompt-tokens of held-out files, as token ids, the same BOS rule) for
   32 tokens by llama-server (/completion, prompt as ids, top-k 1, EOS ignored) and by `weightstream generate
   DIR --prompt-ids ...`: tokens equal before the first difference, per prompt.

The bf16 GGUF is scored the same way beside our bf16 checkpoint (the sanity row: llama.cpp's converter and
graph against ours). Files go to $WEIGHTSTREAM_CACHE/small-moe/gguf (default ~/.cache/weightstream; small-moe-ARCH
for another --arch); the conversion, quantization and imports are redone on every run (seconds for this model), so
a run after a change to the importer measures the new one.

    .venv/bin/python benchmarks/quant_bench.py quality --minutes 8    # trains the model once
    .venv/bin/python benchmarks/gguf_import.py quality    # -> benchmarks/results/gguf-quality-small-moe.json
    .venv/bin/python benchmarks/quant_bench.py quality --arch deepseek_v3 --steps 500 --threads 1 --groups ""
    .venv/bin/python benchmarks/gguf_import.py quality --arch deepseek_v3 --types Q8_0,Q4_K_M,Q2_K
        # -> benchmarks/results/gguf-quality-small-deepseek_v3.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import llamacpp
from common.clients import free_port
from common.results import default, emit

from parts.quant_quality import CONFIGS, cache_dir, corpus, perplexity

_CLI = os.path.join(os.path.dirname(sys.executable), "weightstream")  # the venv's console script
WEIGHTSTREAM = [_CLI] if os.path.exists(_CLI) else [sys.executable, "-m", "weightstream.cli"]
N_CTX = 256
# llama-quantize types each architecture also gets: gpt-oss's own expert type (its release stores experts in MXFP4;
# MXFP4_MOE quantizes the experts so and the rest as Q8_0)
EXTRA_TYPES = {"gpt_oss": ("MXFP4_MOE",)}
# architectures whose quantized files llama.cpp runs only without its CPU "extra" buffer types (--no-repack: the
# repacked and AMX weight layouts). On a CPU with AMX (llama.cpp built with GGML_NATIVE puts Q8_0, Q4_K, MXFP4, ...
# weights in its AMX buffer first), a deepseek2 file of Q8_0, Q4_K_M or Q2_K aborts while building its graph
# (ggml-backend.cpp: GGML_ASSERT(*cur_backend_id != -1), from llama_context's graph_reserve), a gpt-oss Q8_0 file
# segfaults and its MXFP4_MOE file dies of SIGILL; bf16 files run either way, and with --no-repack every one runs
NO_REPACK = {"deepseek_v3", "gpt_oss"}


def say(msg: str) -> None:
    print(f"[gguf-quality] {msg}", file=sys.stderr, flush=True)


def gguf_facts(path: str) -> dict:
    """The file's tokenizer settings that decide the token ids, and how many tensors of each type it stores."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    types = Counter(t.tensor_type.name for t in reader.tensors)
    kinds = {}
    for t in reader.tensors:  # blk.N.ffn_down_exps.weight -> ffn_down_exps
        kinds.setdefault(re.sub(r"^blk\.\d+\.", "", t.name).removesuffix(".weight"), Counter())[t.tensor_type.name] += 1
    return {
        "bytes": os.path.getsize(path),
        "pre_tokenizer": field("tokenizer.ggml.pre"),
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "tensor_types": dict(types),
        "types_by_tensor": {k: dict(v) for k, v in sorted(kinds.items())},
    }


def held_text(tokenizer, tokens_needed: int) -> str:
    """Held-out files joined by blank lines until the text holds `tokens_needed` tokens, no trailing newline
    (llama.cpp drops one from a prompt file)."""
    parts, count = [], 0
    for text in corpus()[1]:
        parts.append(text)
        count += len(tokenizer(text).input_ids)
        if count > tokens_needed * 1.1 + 1000:
            break
    return "\n\n".join(parts).rstrip("\n")


def llama_tokens(gguf: str, text_file: str) -> list[int]:
    """llama.cpp's token ids of the file, as llama-perplexity gets them (BOS first if the file adds one)."""
    done = subprocess.run(
        [str(llamacpp.tool("llama-tokenize")), "-m", gguf, "-f", text_file, "--ids", "--no-escape", "--log-disable"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_perplexity(
    gguf: str, text_file: str, chunks: int, threads: int, tries: int = 8, extra: tuple[str, ...] = ()
) -> dict:
    """llama-perplexity's final estimate. llama.cpp logs through a thread its programs do not wait for at exit
    (common/log.cpp: the logger is leaked on purpose, "logs may be lost"): on a loaded machine the last lines, the
    final estimate among them, are lost now and then, so a run that printed none is run again."""
    argv = [str(llamacpp.tool("llama-perplexity")), "-m", gguf, "-f", text_file, "-c", str(N_CTX), "-b", str(N_CTX)]
    argv += ["-t", str(threads), "--chunks", str(chunks), "--no-escape", *extra]  # no-escape: the docstring
    runs = 0
    while True:
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True)
        runs += 1
        out = done.stdout + done.stderr
        final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
        if done.returncode != 0 or final is not None or runs == tries:
            break
    n_chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
    if done.returncode != 0 or final is None:
        raise SystemExit(f"llama-perplexity failed ({done.returncode}, {runs} runs): {out[-2000:]}")
    return {
        "perplexity": float(final.group(1)),
        "plus_minus": float(final.group(2)),
        "chunks": int(n_chunks.group(1)),
        "runs": runs,
        "seconds": time.perf_counter() - start,
    }


def windows(ids: list[int], chunks: int, bos: int | None):
    """llama-perplexity's windows: consecutive N_CTX tokens, the first replaced by BOS where BOS is added."""
    import torch

    out = []
    for i in range(chunks):
        w = list(ids[i * N_CTX : (i + 1) * N_CTX])
        if bos is not None:
            w[0] = bos
        out.append(w)
    return torch.tensor(out)


def import_gguf(gguf: str, out: str) -> dict:
    done = subprocess.run(
        [*WEIGHTSTREAM, "import", gguf, "--out", out, "--force", "--json"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"weightstream import {gguf} failed: {done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    notes = [line.removeprefix("weightstream import: ") for line in done.stderr.splitlines() if "import:" in line]
    keep = ("scheme", "activation_dtype", "expert_types", "layer_tables", "requantized", "tokenizer", "seconds")
    return {k: summary.get(k) for k in keep} | {"notes": notes}


def dense_storage(model_dir: str) -> dict:
    """How the imported directory stores dense weights: block types from its manifest, or the float dtype."""
    from weightstream.store.model import map_model

    mapped = map_model(model_dir)
    quant = mapped.quant
    dense = dict(Counter(t for t, _ in (quant.dense or {}).values())) if quant else {}
    return {"experts": quant.scheme if quant else str(mapped.model.dtype), "dense_block_types": dense}


class LlamaServer:
    """llama-server on a free local port, for greedy completions from token ids."""

    def __init__(self, gguf: str, threads: int, extra: tuple[str, ...] = ()):
        self.port = free_port()
        argv = [str(llamacpp.tool("llama-server")), "-m", gguf, "-c", "512", "-t", str(threads), "-np", "1"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"llama-server did not start: {self.proc.stderr.read()[-2000:]}")
            time.sleep(0.5)

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[list]]:
        """`n` greedy tokens after `ids`, and at each step llama.cpp's two likeliest tokens [[id, logprob], ...]."""
        body = {
            "prompt": ids,
            "n_predict": n,
            "samplers": ["top_k"],
            "top_k": 1,
            "n_probs": 2,
            "ignore_eos": True,
            "cache_prompt": False,
            "return_tokens": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            reply = json.loads(r.read())
        top = [[[t["id"], t["logprob"]] for t in p["top_logprobs"]] for p in reply["completion_probabilities"]]
        return reply["tokens"], top

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def engine_greedy(model_dir: str, ids: list[int], n: int, kv_dtype: str = "auto") -> list[int]:
    argv = [*WEIGHTSTREAM, "generate", model_dir, "--prompt-ids", ",".join(map(str, ids))]
    argv += ["--max-new-tokens", str(n), "--expert-cache", "100x", "--json", "--kv-dtype", kv_dtype]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"weightstream generate {model_dir} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["token_ids"]


def agreement(ours: list[int], theirs: tuple[list[int], list[list]]) -> dict:
    """Tokens equal before the first difference; at that difference, llama.cpp's two likeliest tokens and the
    gap between their log-probabilities (a near tie: a small gap, weightstream's token llama.cpp's second)."""
    theirs, top = theirs
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    row = {"equal_prefix": same, "all_equal": ours == theirs}
    if same < min(len(ours), len(theirs)):
        (first, lp1), (second, lp2) = top[same][:2]
        row["at_difference"] = {
            "weightstream": ours[same],
            "llama_cpp_top2": [first, second],
            "llama_cpp_logprob_gap": lp1 - lp2,
            "weightstream_is_llama_second": ours[same] == second,
        }
    return row | {"weightstream": ",".join(map(str, ours)), "llama_cpp": ",".join(map(str, theirs))}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--arch",
        choices=sorted(CONFIGS),
        default="qwen3_moe",
        help="which trained model (quant_bench.py quality --arch ARCH; default qwen3_moe)",
    )
    ap.add_argument(
        "--types", default="Q8_0,Q4_K_M", help="llama-quantize types (default Q8_0,Q4_K_M; gpt_oss also MXFP4_MOE)"
    )
    ap.add_argument("--chunks", type=int, default=64, help="windows of 256 tokens scored (default 64)")
    ap.add_argument("--prompts", type=int, default=8, help="greedy prompts: openings of held-out files (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=48, help="tokens of each prompt (default 48)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    ap.add_argument(
        "--repack",
        choices=("on", "off"),
        help="llama.cpp's weight repacking (its CPU extra buffer types; off: --no-repack to llama-perplexity and "
        f"llama-server). Default on, off for {', '.join(sorted(NO_REPACK))} (NO_REPACK says why)",
    )
    ap.add_argument(
        "--kv-dtype",
        default="auto",
        choices=("auto", "float16", "bfloat16", "q8_0"),
        help="the dtype our side keeps DeepSeek's latent cache in (generate --kv-dtype; default auto: the model's, "
        "float32 for an import). llama.cpp's side keeps its default, an f16 KV cache, unless --llama-ctk",
    )
    ap.add_argument(
        "--llama-ctk",
        default="f16",
        choices=("f16", "q8_0"),
        help="llama.cpp's KV cache type: f16 (default) or q8_0, to hold --kv-dtype q8_0 against llama.cpp's own (-ctk "
        "and -ctv both, which DeepSeek's latent attention needs equal, and -fa on, which a quantized V cache needs)",
    )
    ap.add_argument(
        "--out",
        help="result file (default: benchmarks/results/gguf-quality-small-moe.json for qwen3_moe, "
        "gguf-quality-small-ARCH.json otherwise)",
    )
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    cache = cache_dir(args.arch)
    stem = cache.name  # small-moe, small-moe-ARCH: the GGUFs' names
    out = args.out or default(
        "gguf-quality-small-moe.json" if args.arch == "qwen3_moe" else f"gguf-quality-small-{args.arch}.json"
    )
    types = args.types.split(",")
    types += [t for t in EXTRA_TYPES.get(args.arch, ()) if t not in types]
    repack = args.repack == "on" if args.repack else args.arch not in NO_REPACK
    llama_extra = () if repack else ("--no-repack",)
    if args.llama_ctk != "f16":
        llama_extra += ("-ctk", args.llama_ctk, "-ctv", args.llama_ctk, "-fa", "on")
    flags = "".join(" " + a for a in llama_extra)
    bf16 = cache / "bf16"
    if not (bf16 / "config.json").exists():
        train = "quality" if args.arch == "qwen3_moe" else f"quality --arch {args.arch}"
        raise SystemExit(f"{bf16}: no model; train it first: .venv/bin/python benchmarks/quant_bench.py {train}")
    if llamacpp.build() is None:
        raise SystemExit("llama.cpp is not built here (no compiler or cmake)")
    work = cache / "gguf"
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(bf16)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "arch": args.arch,
        "model": str(bf16).replace(str(Path.home()), "~", 1),
        "training": json.loads((cache / "training.json").read_text()),
        "llama_cpp": llamacpp.source_tree().parents[1].name,
        "llama_cpp_repack": repack,
        "kv_dtype": {
            "weightstream": args.kv_dtype,
            "llama.cpp": "f16 (its default)" if args.llama_ctk == "f16" else " ".join(llama_extra[-6:]),
        },
        "protocol": f"llama-perplexity -c {N_CTX} -b {N_CTX} --chunks {args.chunks}{flags}: windows of {N_CTX} tokens, "
        f"positions {N_CTX // 2}..{N_CTX - 2} scored ({N_CTX - 1 - N_CTX // 2} per window), BOS first per window "
        "where the GGUF adds BOS; weightstream the same on llama-tokenize's ids",
    }

    # GGUFs: converted anew (the pre-tokenizer name decides llama.cpp's tokens), then quantized
    ggufs = {"BF16": str(work / f"{stem}.BF16.gguf")}
    for path in [ggufs["BF16"]] + [str(work / f"{stem}.{t}.gguf") for t in types]:
        if os.path.exists(path):
            os.remove(path)
    llamacpp.convert(str(bf16), ggufs["BF16"], "bf16", pre="gpt-2")
    for qtype in types:
        ggufs[qtype] = llamacpp.quantize(ggufs["BF16"], str(work / f"{stem}.{qtype}.gguf"), qtype, args.threads)
    facts = {name: gguf_facts(path) for name, path in ggufs.items()}

    # one held-out text, its token ids by both tokenizers
    text_file = work / "held.txt"
    text = held_text(tokenizer, (args.chunks + 1) * N_CTX)
    text_file.write_text(text, encoding="utf-8")
    ours = tokenizer(text).input_ids
    add_bos = facts["BF16"]["add_bos_token"]
    bos = facts["BF16"]["bos_token_id"] if add_bos else None
    theirs = llama_tokens(ggufs["BF16"], str(text_file))
    expected = ([bos] if add_bos else []) + ours
    first_diff = next((i for i, (a, b) in enumerate(zip(expected, theirs)) if a != b), None)
    report["tokens"] = {
        "text_chars": len(text),
        "ours": len(ours),
        "llama_cpp": len(theirs),
        "add_bos": add_bos,
        "bos_token_id": bos,
        "identical": expected == theirs,
        "first_difference": first_diff,
    }
    if expected != theirs:
        report["tokens"]["context"] = {
            "ours": expected[first_diff : first_diff + 8],
            "llama_cpp": theirs[first_diff : first_diff + 8],
        }
        print(json.dumps(report, indent=1))
        raise SystemExit("token ids differ between our tokenizer and llama.cpp's: nothing scored")
    wins = windows(theirs, args.chunks, bos)

    # imports, then perplexity on both sides
    dirs = {}
    imports = {}
    for name, path in ggufs.items():
        dirs[name] = str(work / f"imported-{name}")
        say(f"weightstream import {path}")
        imports[name] = import_gguf(path, dirs[name]) | dense_storage(dirs[name])
    rows = {}
    for name, path in ggufs.items():
        say(f"perplexity of {name}")
        llama = llama_perplexity(path, str(text_file), args.chunks, args.threads, extra=llama_extra)
        ws = perplexity(dirs[name], wins, first=N_CTX // 2, kv_dtype=args.kv_dtype)
        rows[name] = {
            "llama_perplexity": llama["perplexity"],
            "llama_plus_minus": llama["plus_minus"],
            "llama_chunks": llama["chunks"],
            "llama_runs": llama["runs"],
            "weightstream_imported": ws,
            "relative_difference": ws / llama["perplexity"] - 1,
            "within_1_percent": abs(ws / llama["perplexity"] - 1) <= 0.01,
        }
    ckpt = perplexity(str(bf16), wins, first=N_CTX // 2, kv_dtype=args.kv_dtype)
    rows["BF16"]["weightstream_our_bf16_checkpoint"] = ckpt
    rows["BF16"]["our_checkpoint_vs_llama_bf16"] = ckpt / rows["BF16"]["llama_perplexity"] - 1
    report["perplexity"] = rows

    # greedy tokens from the openings of held-out files
    prompts = [([bos] if add_bos else []) + tokenizer(t).input_ids[: args.prompt_tokens] for t in corpus()[1]]
    prompts = prompts[: args.prompts]
    greedy = {}
    for name, path in ggufs.items():
        say(f"greedy tokens of {name}")
        server = LlamaServer(path, args.threads, llama_extra)
        try:
            theirs_g = [server.greedy(p, args.new_tokens) for p in prompts]
        finally:
            server.close()
        per = [
            agreement(engine_greedy(dirs[name], p, args.new_tokens, args.kv_dtype), t)
            for p, t in zip(prompts, theirs_g)
        ]
        greedy[name] = {
            "prompts_all_equal": sum(p["all_equal"] for p in per),
            "equal_prefix": [p["equal_prefix"] for p in per],
            "tokens_equal_in_place": sum(
                a == b for p in per for a, b in zip(p["weightstream"].split(","), p["llama_cpp"].split(","))
            ),
            "tokens": args.new_tokens * len(prompts),
            "per_prompt": per,
        }
    report["greedy"] = greedy
    report["summary"] = {
        name: {
            "llama_perplexity": rows[name]["llama_perplexity"],
            "weightstream_perplexity": rows[name]["weightstream_imported"],
            "relative_difference": rows[name]["relative_difference"],
            "greedy_prompts_all_equal": f"{greedy[name]['prompts_all_equal']}/{len(prompts)}",
            "greedy_equal_prefix": greedy[name]["equal_prefix"],
        }
        for name in ggufs
    }
    report["gguf"] = facts
    report["import"] = imports
    first = ("date", "arch", "model", "llama_cpp", "training", "protocol", "tokens", "summary")
    report = {k: report[k] for k in first} | {k: v for k, v in report.items() if k not in first}
    emit(report, out)
