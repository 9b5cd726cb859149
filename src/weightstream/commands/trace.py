"""`weightstream trace`: import third-party routing dumps, record routing with the engine, summarise a trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from weightstream.errors import WeightstreamError

MIB = 2**20

IMPORT_EPILOG = """\
formats:
  vllm-jsonl      one JSON object per (token, layer): {"problem_id", "token_idx", "layer", "experts",
                  "gating_probs"}; each (file, problem_id) is a request of decode tokens
  moe-beyond-csv  CSV "Layer ID,Batch Number,Token,Activated Expert IDs", rows layer-major; each file is a
                  request (prompt tokens), replayed token-major, one step per token

shapes by name: mixtral-8x7b, deepseek-v2-lite, qwen3-30b-a3b, olmoe-1b-7b, gpt-oss-20b, or a config.json
(expert bytes = 3 x hidden x expert intermediate x 2 bytes (bf16), plus biases for gpt-oss).

examples:
  weightstream trace import $(ls dumps/deepseek-v2-lite-chat/*.csv | sort -V) \\
      --format moe-beyond-csv --model-shape deepseek-v2-lite -o ds.npz
  weightstream trace import dumps/mixtral/gsm8k_routing.jsonl --format vllm-jsonl --model-shape mixtral-8x7b -o mix.npz
"""

TRACE_EPILOG = """\
examples:
  weightstream trace record .work/demo-model --prompts prompts.txt --max-new-tokens 64 -o mine.npz
  weightstream trace info mine.npz
  weightstream simulate mine.npz --policies lru,slru,belady --sizes 1x,2x,4x
"""


def register(sub) -> None:
    p = sub.add_parser(
        "trace",
        help="import, record or inspect expert-routing traces (input of `simulate`)",
        description="Routing traces: which experts each token chose in each MoE layer, recorded by the engine or "
        "imported from other tools' dumps; the input of `simulate` and `tune --trace`.",
        epilog=TRACE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    imp = tsub.add_parser(
        "import",
        help="convert third-party routing dumps into a trace file",
        description="Convert routing dumps into a weightstream trace; files are requests, replayed in the order given.",
        epilog=IMPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imp.add_argument("files", nargs="+", help="input files, in replay order")
    imp.add_argument("--format", required=True, choices=("vllm-jsonl", "moe-beyond-csv"), help="input format")
    imp.add_argument("--model-shape", required=True, help="known model name or path to a transformers config.json")
    imp.add_argument("--expert-bytes", type=int, help="override bytes of one expert (e.g. a quantized checkpoint)")
    imp.add_argument("-o", "--out", required=True, help="output trace file (.npz)")
    imp.set_defaults(func=run_import)
    rec = tsub.add_parser(
        "record",
        help="generate greedily with the streaming engine and record its routing",
        description="Greedy generation over real prompts with weightstream's engine, recording "
        "the experts chosen at prefill and at every decode step.",
        epilog="example:\n  weightstream trace record .work/demo-model --prompts prompts.txt --max-new-tokens 64 -o "
        "mine.npz\n(prompts.txt: one prompt a line, or .jsonl with a 'prompt' field)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rec.add_argument("model_dir", help="Hugging Face model directory (config.json + safetensors)")
    rec.add_argument("--prompts", required=True, help="prompts file: one prompt per line, or .jsonl with 'prompt'")
    rec.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    rec.add_argument("-o", "--out", required=True, help="output trace file (.npz)")
    rec.set_defaults(func=run_record)
    info = tsub.add_parser(
        "info",
        help="summarise a trace file: shape, requests, tokens, lookups",
        description="Summarise a trace file: the model shape it was made for, its requests, steps, prefill and "
        "decode tokens, expert lookups and one token's working set.",
        epilog="example:\n  weightstream trace info ds.npz --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    info.add_argument("trace", help="trace file (.npz)")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=run_info)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_import(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from weightstream.trace import resolve_shape, save
    from weightstream.trace.importers import IMPORTERS

    shape = resolve_shape(args.model_shape, args.expert_bytes)
    if not Path(args.out).resolve().parent.is_dir():
        raise WeightstreamError(f"{args.out}: its directory does not exist; create it or choose another -o")
    for f in args.files:
        if not Path(f).is_file():
            raise WeightstreamError(f"{f}: no such input file")
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"importing {len(args.files)} file(s)", total=len(args.files))
        trace = IMPORTERS[args.format](args.files, shape, on_file=lambda path: progress.advance(task))
    save(trace, args.out)
    print(
        f"{args.out}: {len(trace.requests)} requests, {trace.n_tokens} tokens, {trace.n_accesses} expert lookups "
        f"({shape.name}: {len(shape.layers)} routed layers x top-{shape.top_k} of {shape.n_experts})"
    )
    return 0


def run_record(args) -> int:
    if args.max_new_tokens < 0:
        raise WeightstreamError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    from weightstream.bench.prompts import read_prompts
    from weightstream.engine.routing import record_trace

    prompts = read_prompts(args.prompts)
    record_trace(args.model_dir, prompts, args.max_new_tokens, args.out)
    print(f"{args.out}: routing of {len(prompts)} prompt(s) recorded")
    return 0


def run_info(args) -> int:
    from weightstream.trace import load

    t = load(args.trace)
    decode = int(t.step_tokens[t.step_phase == 1].sum())
    info = {
        "shape": t.shape.to_dict(),
        "requests": len(t.requests),
        "steps": t.n_steps,
        "tokens": t.n_tokens,
        "decode_tokens": decode,
        "prefill_tokens": t.n_tokens - decode,
        "accesses": t.n_accesses,
        "working_set_slots": t.shape.working_set_slots,
        "working_set_bytes": t.shape.working_set_bytes,
        "router_weights": t.weights is not None,
    }
    if args.json:
        print(json.dumps(info))
        return 0
    s = t.shape
    print(
        f"{args.trace}: {s.name}, routed layers {s.layers[0]}..{s.layers[-1]} ({len(s.layers)}), top-{s.top_k} "
        f"of {s.n_experts} experts, {s.expert_bytes[0] / MIB:.2f} MiB per expert"
    )
    print(
        f"  {info['requests']} requests, {t.n_steps} steps, {t.n_tokens} tokens ({decode} decode), "
        f"{t.n_accesses} expert lookups, router weights {'yes' if info['router_weights'] else 'no'}"
    )
    print(f"  one token's working set: {s.working_set_slots} experts = {s.working_set_bytes / MIB:.0f} MiB")
    return 0
