"""`weightstream tune`'s answer: the report object (`--json`), its table and lines, the command to run, the plot."""

from __future__ import annotations

import json
import shlex

from weightstream.commands.tune_steps import Cost
from weightstream.sim.advice import llamacpp_advice, recommend, verdict
from weightstream.sim.replay import pinned_set
from weightstream.sim.tune import Config, Search
from weightstream.units import GIB, MIB

EXAMPLE_PROMPT = "Hello"


def generate_command(
    model_dir: str,
    rec: Config,
    io_threads: int,
    max_new_tokens: int,
    pinned: str | None,
    memory: str | None = None,
    largest_cache: int | None = None,
):
    """argv of the `weightstream generate` run that uses the recommended configuration. Where that is an expert
    cache as large as the budget allows (`largest_cache`, the largest size priced) and not a pinned set, the command
    gives `--memory` (tune's own SIZE, `memory`): the engine then measures its footprint and takes the largest
    cache that fits (docs/memory.md), at least the one priced here; otherwise it names the cache size."""
    argv = ["weightstream", "generate", model_dir]
    if rec.path == "page-cache":
        argv += ["--expert-source", "page-cache"]
    else:
        sized = memory is not None and rec.cache_bytes == largest_cache and not pinned
        argv += ["--memory", memory] if sized else ["--expert-cache", str(rec.cache_bytes)]
        argv += ["--policy", rec.policy, "--io-threads", str(io_threads)]
        if pinned:
            argv += ["--pinned-experts", pinned]
    return argv + ["--max-new-tokens", str(max_new_tokens), "--prompt", EXAMPLE_PROMPT]


def build_report(
    session,
    trace,
    routing: dict,
    cost: Cost,
    policies: list[str],
    max_new_tokens: int,
    gpu_memory_bytes: int | None,
) -> dict:
    """Search, recommend and advise; everything `--json` prints. `gpu_memory_bytes` as `tune --gpu-memory` gave it
    (parsed and checked with the other arguments, `commands.tune._check_args`)."""
    search = Search(trace, session.facts, cost.params, cost.linear)
    configs = search.run(session.budget.expert_bytes, policies)
    rec, reason = recommend(configs)
    pinned = None
    if rec.policy == "pinned":
        pinned = session.write_pinned(pinned_set(search.w, rec.slots, search.options), rec.slots)
    who_wins = verdict(configs)
    page = next(c for c in configs if c.path == "page-cache")
    largest = max((c.cache_bytes for c in configs if c.path != "page-cache"), default=None)
    memory = f"{session.budget.memory_bytes // MIB}MiB"
    command = generate_command(session.model_dir, rec, session.io_threads, max_new_tokens, pinned, memory, largest)
    return {
        "model": session.model_dir,
        "budget": session.budget.to_dict(),
        "routing": routing,
        "calibration": cost.info,
        "cost_model": "linear (bench)" if cost.linear is not None else "overlap",
        "configs": [c.to_dict() for c in configs],
        "recommendation": {**rec.to_dict(), "reason": reason, "command": command, "pinned_experts_file": pinned},
        "page_cache_vs_expert_cache": {
            "winner": who_wins.winner,
            "ratio": who_wins.ratio,
            "expert_cache_loses_up_to_bytes": who_wins.loses_up_to_bytes,
            "line": who_wins.line,
        },
        "llama_cpp": llamacpp_advice(session.facts, session.budget, page, gpu_memory_bytes, who_wins),
    }


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(report: dict) -> list[str]:
    ws = report["budget"]["working_set_bytes"]
    rec = report["recommendation"]
    lines = [
        f"{'':2}{'path':<13}{'policy':<19}{'cache GiB':>10}{'x WS':>8}{'hit rate':>9}{'MiB/token':>10}"
        f"{'tok/s':>8}{'prefill s':>10}{'of Belady':>10}"
    ]
    for c in report["configs"]:
        mark = (
            "*"
            if (c["path"], c["policy"], c["cache_bytes"]) == (rec["path"], rec["policy"], rec["cache_bytes"])
            else ""
        )
        lines.append(
            f"{mark:<2}{c['path']:<13}{c['policy'] + (' (bound)' if c['bound'] else ''):<19}"
            f"{c['cache_bytes'] / GIB:>10.2f}{c['cache_bytes'] / ws:>8.2f}{c['hit_rate']:>9.1%}"
            f"{c['mib_read_per_token']:>10.1f}{_fmt(c['predicted_decode_tokens_per_s'], '.2f'):>8}"
            f"{_fmt(c['predicted_prefill_s'], '.2f'):>10}{_fmt(c.get('of_belady_tokens_per_s'), '.2f'):>10}"
        )
    return lines


def text(report: dict) -> list[str]:
    b, r, rec = report["budget"], report["routing"], report["recommendation"]
    out = [
        f"model {report['model']}: memory {b['memory_bytes'] / GIB:.2f} GiB = dense "
        f"{b['resident_dense_bytes'] / GIB:.2f} + "
        f"KV ({b['context_tokens']} tokens) {b['kv_cache_bytes'] / GIB:.2f} + runtime "
        f"{b['runtime_overhead_bytes'] / GIB:.2f} + experts {b['expert_bytes'] / GIB:.2f} GiB "
        f"(one token's working set {b['working_set_bytes'] / GIB:.2f} GiB)"
        + (
            f"; the input embedding's {b['lazy_dense_bytes'] / GIB:.2f} GiB stays on disk (mmap reads only the rows "
            "of tokens seen)"
            if b["lazy_dense_bytes"]
            else ""
        ),
        f"routing: {r['source']} {r.get('file') or r.get('prompts')}: {r['requests']} requests, {r['tokens']} tokens"
        + (f"; {r['replayed']}" if "replayed" in r else "")
        + (f"; {r['note']}" if "note" in r else ""),
        f"cost model: {report['cost_model']} ({report['calibration']['source']}{_samples(report['calibration'])})",
        "",
        *table(report),
        "",
        f"recommendation: {rec['path']} {rec['policy']} {rec['cache_bytes'] / GIB:.2f} GiB, predicted "
        f"{_fmt(rec['predicted_decode_tokens_per_s'], '.2f', 'unknown')} tok/s decode, "
        f"{_fmt(rec['predicted_prefill_s'], '.2f', 'unknown')} s prefill ({rec['reason']})",
        f"  {shlex.join(rec['command'])}",
        f"page cache vs expert cache: {report['page_cache_vs_expert_cache']['line']}",
        *[f"  {line}" for line in report["llama_cpp"]],
        f"tune took {report['timings_s']['total']:.1f} s",
    ]
    return out


def _samples(calibration: dict) -> str:
    """'; median of 3 calibrations, ...' where more than one priced the answer, naming the terms that moved most."""
    n = calibration.get("samples", 1)
    if n < 2:
        return ""
    moved = sorted(((v, k) for k, v in calibration.get("spread", {}).items() if v is not None), reverse=True)[:2]
    apart = ", ".join(f"{k} {v:.0%}" for v, k in moved)
    return f"; median of this machine's last {n} calibrations" + (f", most apart: {apart}" if apart else "")


def emit(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
    else:
        print("\n".join(text(report)))


def plot(report: dict, out: str) -> None:
    from weightstream.sim.plot import plot_predictions

    plot_predictions(report["configs"], report["budget"]["working_set_bytes"], out, title=report["model"])
