"""llama.cpp beside weightstream, for benchmarks only: build it once, convert and quantize our checkpoints, time it;
and every speed comparison with it, each on the same GGUF file and its `weightstream import`, rounds alternated.

llama.cpp comes from the vendored tree of the `llama-cpp-python` source package on PyPI (no binary wheel exists for
this platform), downloaded and built once into a cache outside the repository: $WEIGHTSTREAM_CACHE/llama.cpp, by
default ~/.cache/weightstream/llama.cpp. Only llama-bench, llama-cli, llama-quantize and llama-perplexity are built
(about 20 minutes on 2 cores). Where there is no compiler or cmake, `build()` returns None and says why, and the
benchmarks that use it report llama.cpp as skipped. Other scripts import this file (`import llamacpp`) for these.

    .venv/bin/python benchmarks/llamacpp.py build
    .venv/bin/python benchmarks/llamacpp.py convert MODEL_DIR OUT.gguf [--outtype bf16] [--pre gpt-2]
    .venv/bin/python benchmarks/llamacpp.py quantize IN.gguf OUT.gguf Q4_K_M
    .venv/bin/python benchmarks/llamacpp.py bench OUT.gguf [--memory-limit 2GiB] [--timeout 900]

The comparisons (each `llamacpp.py PART --help`; each prints one JSON object and writes it to --out):

    speed      in-memory prompt and decode tok/s against llama-bench; --depths: at context depths (gguf_speed)
    serve      `weightstream serve` against llama-server, concurrent clients (serve_vs_llamacpp)
    prefill    time to the first token of a long prompt in a memory cgroup, against llama-bench (prefill_limit)
    products   every block type's native product against llama.cpp's through ggml (--against-llamacpp) and/or
               another checkout's build (--against) (block_types)

(the modules under benchmarks/common/ that run them in parentheses)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from common import Part, run_part

CACHE = Path(os.environ.get("WEIGHTSTREAM_CACHE") or Path.home() / ".cache" / "weightstream") / "llama.cpp"
TARGETS = ("llama-bench", "llama-cli", "llama-quantize", "llama-perplexity")

# The converter stops on a tokenizer whose pre-tokenizer hash it does not know (ours is trained locally), and on a
# GLM tokenizer without GLM's special tokens (GLM's is written as GPT-2's instead), so the pre-tokenizer's
# name is forced: llama.cpp's "default" where the vocabulary does not matter (speed), "gpt-2" where llama.cpp must
# split text as our tokenizers do (GPT-2's ByteLevel pre-tokenizer; `gguf_import.py quality`).
_CONVERT = """
import runpy, sys
sys.path.insert(0, {tree!r})
sys.path.insert(1, {gguf!r})
import conversion.base as base
import conversion.glm as glm
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
# GLM's vocabulary needs GLM's own special tokens ([gMASK], ...), which a synthetic tokenizer lacks
glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def say(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def source_tree() -> Path:
    """vendor/llama.cpp of the llama-cpp-python source package, downloaded and unpacked once."""
    found = sorted(glob.glob(str(CACHE / "llama_cpp_python-*" / "vendor" / "llama.cpp")))
    if found:
        return Path(found[-1])
    CACHE.mkdir(parents=True, exist_ok=True)
    say("downloading the llama-cpp-python source package (77 MB)")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "llama-cpp-python",
            "-d",
            str(CACHE),
        ],
        check=True,
        capture_output=True,
    )
    archive = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))[-1]
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    return source_tree()


def build() -> Path | None:
    """The directory holding the built tools, building them first if needed; None (and why) without a compiler."""
    bin_dir = CACHE / "build" / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    missing = [tool for tool in ("cmake", "cc", "c++") if shutil.which(tool) is None]
    if missing:
        say(f"not built: {', '.join(missing)} not found; llama.cpp figures are skipped")
        return None
    tree = source_tree()
    say(f"building {', '.join(TARGETS)} from {tree} (about 20 minutes on 2 cores)")
    flags = [
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DCMAKE_BUILD_TYPE=Release",
    ]
    subprocess.run(["cmake", "-S", str(tree), "-B", str(CACHE / "build"), *flags], check=True, capture_output=True)
    subprocess.run(
        ["nice", "cmake", "--build", str(CACHE / "build"), f"-j{os.cpu_count()}", "--target", *TARGETS],
        check=True,
        capture_output=True,
    )
    return bin_dir


def tool(name: str) -> Path | None:
    """The path of one llama.cpp program (llama-tokenize, llama-server, ...), building it first if it is not one
    of those `build()` makes (a link of the libraries already built: about a minute); None without a compiler."""
    bin_dir = build()
    if bin_dir is None:
        return None
    if not (bin_dir / name).exists():
        say(f"building {name}")
        subprocess.run(
            ["nice", "cmake", "--build", str(CACHE / "build"), f"-j{os.cpu_count()}", "--target", name],
            check=True,
            capture_output=True,
        )
    return bin_dir / name


def product_tool() -> Path | None:
    """benchmarks/ggml_product.c linked against the ggml libraries `build()` made: llama.cpp's own product of one
    block type (`ggml_product TYPE N K THREADS CALLS`); rebuilt when the source is newer; None without a compiler."""
    bin_dir = build()
    if bin_dir is None:
        return None
    source, out = Path(__file__).with_name("ggml_product.c"), CACHE / "ggml_product"
    if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
        libs = CACHE / "build" / "ggml" / "src"
        subprocess.run(
            [
                "cc",
                "-O2",
                f"-I{source_tree() / 'ggml' / 'include'}",
                str(source),
                "-o",
                str(out),
                str(libs / "libggml-cpu.a"),
                str(libs / "libggml-base.a"),
                "-lstdc++",
                "-lgomp",
                "-lpthread",
                "-lm",
            ],
            check=True,
        )
    return out


def convert(model_dir: str, out: str, outtype: str = "bf16", pre: str = "default") -> str:
    """GGUF of a Hugging Face checkpoint directory by llama.cpp's own converter (kept if already there), its
    tokenizer's pre-tokenizer named `pre` (llama.cpp's name: "default", "gpt-2", ...)."""
    if os.path.exists(out):
        return out
    tree = source_tree()
    argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", outtype, "--outfile", out + ".part"]
    code = _CONVERT.format(
        tree=str(tree), gguf=str(tree / "gguf-py"), argv=argv, script=str(tree / "convert_hf_to_gguf.py"), pre=pre
    )
    say(f"converting {model_dir} to {outtype} GGUF")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf failed: {done.stderr[-2000:]}")
    os.rename(out + ".part", out)
    return out


def quantize(src: str, out: str, qtype: str = "Q4_K_M", threads: int = 2) -> str:
    """llama-quantize SRC OUT QTYPE (kept if already there)."""
    if not os.path.exists(out):
        bin_dir = build()
        say(f"quantizing {src} to {qtype}")
        subprocess.run(
            [str(bin_dir / "llama-quantize"), src, out + ".part", qtype, str(threads)], check=True, capture_output=True
        )
        os.rename(out + ".part", out)
    return out


def bench_argv(
    bin_dir: Path, gguf: str, prompt_tokens: int, tokens: int, threads: int, repeats: int, repack: bool
) -> list[str]:
    """llama-bench's command line for a prompt test of `prompt_tokens` and a decode test of `tokens`, JSON out."""
    argv = [str(bin_dir / "llama-bench"), "-m", gguf, "-p", str(prompt_tokens), "-n", str(tokens)]
    argv += ["-t", str(threads), "-r", str(repeats), "-o", "json"]
    return argv + ([] if repack else ["--repack", "0"])


def bench(
    gguf: str,
    threads: int = 2,
    tokens: int = 32,
    repeats: int = 2,
    memory_limit: int | None = None,
    timeout: float = 900.0,
    repack: bool = True,
    prompt_tokens: int = 0,
    decode_depth: int = 0,
) -> dict:
    """Decode tokens/s of llama-bench (tg, after its own warm-up), and with `prompt_tokens` the tokens/s of a prompt
    of that many (pp); under `memory_limit` in a fresh memory cgroup
    from a cold page cache (mmap, as llama.cpp users run it). A run past `timeout` is reported as such.

    llama-bench decodes from an empty context. `decode_depth` puts that many tokens in it first (`-d`), as a decode
    after a prompt has them (the prompt's test stays at depth 0): its attention then reads that many more positions
    a token, which on the 4-layer OLMoE shape took its decode from 131 to 110 tok/s at 256.

    `repack=False` passes `--repack 0`: by default llama.cpp copies Q4_K weights into an interleaved layout in
    anonymous memory at load (2.1 GB resident for the 16-layer OLMoE shape), which no mmap can page out."""
    bin_dir = build()
    if bin_dir is None:
        return {"skipped": "llama.cpp is not built here (no compiler or cmake)"}
    argv = bench_argv(bin_dir, gguf, prompt_tokens, tokens, threads, repeats, repack)
    if decode_depth:
        argv += ["-d", f"0,{decode_depth}"]  # every test at both depths: pp at 0 and tg at decode_depth are kept
    from weightstream.bench.reclaim import paused_proactive_reclaim

    with paused_proactive_reclaim():  # as for weightstream's runs: memory limits alone decide what stays cached
        group = None
        if memory_limit is not None:
            from weightstream.bench.coldstart import drop_page_cache
            from weightstream.cgroup import MemoryCgroup

            drop_page_cache([gguf])
            group = MemoryCgroup.create(memory_limit, name="ws-llama")
        start = time.perf_counter()
        try:
            proc = (group.popen if group else subprocess.Popen)(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                return {"timeout_s": timeout, "error": f"no {tokens}-token run finished in {timeout:.0f} s"}
            peak = group.peak_bytes if group else None
            oom_kills = group.oom_kills if group else None
        finally:
            if group:
                group.remove()
    if proc.returncode != 0:
        if oom_kills:
            return {
                "error": f"killed by the kernel: out of memory in the {memory_limit}-byte cgroup",
                "oom_kills": oom_kills,
                "cgroup_peak_bytes": peak,
                "repack": repack,
            }
        return {"error": f"llama-bench exit {proc.returncode}: {err.strip()[-500:]}", "repack": repack}
    rows = json.loads(out)
    tg = [r for r in rows if r.get("n_gen") and r.get("n_depth", 0) == decode_depth]
    pp = [r for r in rows if r.get("n_prompt") and not r.get("n_gen") and not r.get("n_depth", 0)]
    return {
        **({"prompt_tokens_per_s": pp[0]["avg_ts"], "prompt_tokens": prompt_tokens} if pp else {}),
        "decode_tokens_per_s": tg[0]["avg_ts"],
        "decode_tokens_per_s_stdev": tg[0].get("stddev_ts"),
        "decode_depth": decode_depth,
        "threads": threads,
        "tokens": tokens,
        "repeats": repeats,
        "wall_s": time.perf_counter() - start,
        "memory_limit_bytes": memory_limit,
        "cgroup_peak_bytes": peak,
        "repack": repack,
        "gguf_bytes": os.path.getsize(gguf),
    }


PARTS = {
    "speed": Part("gguf_speed", "in-memory prompt and decode tok/s against llama-bench (--depths: at depths)"),
    "serve": Part("serve_vs_llamacpp", "`weightstream serve` against llama-server, concurrent clients"),
    "prefill": Part("prefill_limit", "time to the first token in a memory cgroup against llama-bench (root)"),
    "products": Part("block_types", "block types' native products against llama.cpp's and/or another build"),
}


def main() -> None:
    if run_part("llamacpp.py", PARTS):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("build", help="build llama.cpp's tools once (about 20 minutes)")
    c = sub.add_parser("convert", help="a checkpoint directory to GGUF by llama.cpp's own converter")
    c.add_argument("model_dir")
    c.add_argument("out")
    c.add_argument("--outtype", default="bf16")
    c.add_argument("--pre", default="default", help="pre-tokenizer name llama.cpp gets (default: default)")
    q = sub.add_parser("quantize", help="llama-quantize")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("qtype")
    b = sub.add_parser("bench", help="llama-bench's decode tok/s, optionally in a memory cgroup")
    b.add_argument("gguf")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--tokens", type=int, default=32)
    b.add_argument("--memory-limit")
    b.add_argument("--timeout", type=float, default=900)
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--repack", type=int, choices=(0, 1), default=1, help="llama-bench --repack (default 1, its own)")
    for name, part in PARTS.items():  # run by run_part above; listed here for --help
        sub.add_parser(name, help=part.help, add_help=False)
    args = ap.parse_args()
    if args.what == "build":
        print(build())
    elif args.what == "convert":
        print(convert(args.model_dir, args.out, args.outtype, args.pre))
    elif args.what == "quantize":
        print(quantize(args.src, args.out, args.qtype))
    else:
        from weightstream.units import parse_size

        limit = parse_size(args.memory_limit, "--memory-limit") if args.memory_limit else None
        print(
            json.dumps(
                bench(
                    args.gguf,
                    args.threads,
                    args.tokens,
                    repeats=args.repeats,
                    memory_limit=limit,
                    timeout=args.timeout,
                    repack=bool(args.repack),
                )
            )
        )


if __name__ == "__main__":
    main()
