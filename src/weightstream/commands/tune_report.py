"""`weightstream tune`'s answer: the report object (`--json`), its table and lines, the command to run, the plot."""

from __future__ import annotations

import json
import shlex

from weightstream.commands.tune_steps import Cost
from weightstream.sim.advice import llamacpp_advice, recommend, verdict
from weightstream.sim.miss_copy import MissCopy
from weightstream.sim.replay import pinned_set
from weightstream.sim.tune import MISS_COPY_UPGRADES, Config, Search
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
    cache that fits (docs/memory.md), at least the one priced here; otherwise it names the cache size. A `--miss-copy`
    configuration (`extra["miss_copy"]`) gets `--miss-copy --upgrade-after` its setting."""
    argv = ["weightstream", "generate", model_dir]
    if rec.path == "page-cache":
        argv += ["--expert-source", "page-cache"]
    else:
        sized = memory is not None and rec.cache_bytes == largest_cache and not pinned
        argv += ["--memory", memory] if sized else ["--expert-cache", str(rec.cache_bytes)]
        argv += ["--policy", rec.policy, "--io-threads", str(io_threads)]
        if pinned:
            argv += ["--pinned-experts", pinned]
        if rec.extra.get("miss_copy"):
            argv += ["--miss-copy", "--upgrade-after", str(rec.extra["upgrade_after"])]
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
    facts = session.facts
    miss_copy = None
    if facts.small_read_bytes:  # the checkpoint has small copies: price --miss-copy too, from the same replays
        miss_copy = MissCopy(facts.small_read_bytes / facts.read_bytes, MISS_COPY_UPGRADES)
    configs = search.run(session.budget.expert_bytes, policies, miss_copy=miss_copy)
    rec, reason = recommend(configs)
    pinned = None
    if rec.policy == "pinned":
        pinned = session.write_pinned(pinned_set(search.w, rec.slots, search.options), rec.slots)
    who_wins = verdict(configs)
    page = next(c for c in configs if c.path == "page-cache")
    largest = max((c.cache_bytes for c in configs if c.path != "page-cache"), default=None)
    memory = f"{session.budget.memory_bytes // MIB}MiB"
    command = generate_command(session.model_dir, rec, session.io_threads, max_new_tokens, pinned, memory, largest)
    if miss_copy is not None:
        small = _miss_copy_answer(session, search, rec, max_new_tokens, memory, largest)
    else:
        small = _miss_copy_hint(session, search, configs, rec)
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
        # --miss-copy, kept apart from the exact configurations above: never the recommendation, tokens not exact
        "miss_copy": small,
    }


MISS_COPY_LABEL = "NOT exact: tokens differ from the model's"


def _miss_copy_answer(session, search: Search, exact: Config, max_new_tokens: int, memory: str, largest) -> dict:
    """--miss-copy priced at every policy, size and upgrade setting (`search.miss_copy_configs`) and its own
    recommendation, labelled as not exact, with the command; compared with the exact recommendation `exact`."""
    configs = search.miss_copy_configs
    rec, reason = recommend(configs)
    pinned = None
    if rec.policy == "pinned":
        pinned = session.write_pinned(pinned_set(search.w, rec.slots, search.options), rec.slots)
    command = generate_command(session.model_dir, rec, session.io_threads, max_new_tokens, pinned, memory, largest)
    tok_s, exact_tok_s = rec.predicted_decode_tokens_per_s, exact.predicted_decode_tokens_per_s
    quant = session.quant
    return {
        "available": True,
        "exact": False,
        "label": MISS_COPY_LABEL,
        "small_copy_bits": quant.miss_copy.bits if quant is not None and quant.miss_copy else None,
        "small_copy_ratio": configs[0].extra["small_copy_ratio"] if configs else None,
        "upgrade_after": [c for c in dict.fromkeys(c.extra["upgrade_after"] for c in configs)],
        "configs": [c.to_dict() for c in configs],
        "recommendation": {
            **rec.to_dict(),
            "reason": reason,
            "command": command,
            "pinned_experts_file": pinned,
            "vs_exact_recommendation_tokens_per_s": tok_s / exact_tok_s if tok_s and exact_tok_s else None,
            "vs_exact_recommendation_mib_read_per_token": rec.mib_read_per_token / exact.mib_read_per_token
            if exact.mib_read_per_token
            else None,
        },
    }


def _miss_copy_hint(session, search: Search, configs: list[Config], exact: Config) -> dict | None:
    """Where a Q4_K checkpoint has no small copies: what `quantize --miss-bits 2` would save, simulated at the exact
    recommendation's policy and size (or the fastest expert cache's, where the page cache is recommended) with the
    copies' bytes estimated from the blob table (Q2_K, Q4_0 where a weight's inputs are not whole blocks of 256)."""
    quant = session.quant
    if quant is None or quant.scheme != "q4_k" or quant.miss_copy is not None:
        return None
    ratio = estimated_small_ratio(quant)
    at = exact if exact.path == "expert-cache" else _fastest_expert_cache(configs)
    if ratio is None or at is None:
        return None
    upgrade, never = search.miss_copy(at.policy, at.cache_bytes, MissCopy(ratio, (1, None)))
    line = (
        f"small copies (`weightstream quantize SRC --bits 4 --miss-bits 2 --out DIR`, SRC the original checkpoint, "
        f"then `--miss-copy`) would make a miss read about {ratio:.2f}x the bytes: at {at.policy} "
        f"{at.cache_bytes / GIB:.2f} GiB a token would read {never.mib_read_per_token:.1f} MiB with --upgrade-after "
        f"never, {upgrade.mib_read_per_token:.1f} with the default upgrade after 1, against "
        f"{at.mib_read_per_token:.1f} exact (simulated; {MISS_COPY_LABEL})"
    )
    return {
        "available": False,
        "exact": False,
        "estimated_small_copy_ratio": ratio,
        "policy": at.policy,
        "cache_bytes": at.cache_bytes,
        "mib_read_per_token": {
            "exact": at.mib_read_per_token,
            "1": upgrade.mib_read_per_token,
            "never": never.mib_read_per_token,
        },
        "line": line,
    }


def _fastest_expert_cache(configs: list[Config]) -> Config | None:
    pool = [c for c in configs if c.path == "expert-cache" and not c.bound]
    return max(pool, key=lambda c: (c.predicted_decode_tokens_per_s or 0, -c.mib_read_per_token), default=None)


def estimated_small_ratio(quant) -> float | None:
    """A Q2_K small copy's bytes over its blob's, from the blob table as `quantize --miss-bits 2` would write it
    (`store.quantize.miss_copy_format`: Q2_K, Q4_0 for a weight whose inputs are not whole super-blocks of 256)."""
    from weightstream.native import BLOCK_TYPES, row_bytes

    small = 0
    for t in quant.tensors:
        if t.dtype not in BLOCK_TYPES:  # biases: kept as they are
            small += t.nbytes
            continue
        n, k = t.shape
        small += n * row_bytes("Q2_K" if k % BLOCK_TYPES["Q2_K"].elements == 0 else "Q4_0", k)
    return small / quant.blob_bytes if quant.blob_bytes else None


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
        *miss_copy_text(report),
        f"page cache vs expert cache: {report['page_cache_vs_expert_cache']['line']}",
        *[f"  {line}" for line in report["llama_cpp"]],
        f"tune took {report['timings_s']['total']:.1f} s",
    ]
    return out


def miss_copy_text(report: dict) -> list[str]:
    """--miss-copy's lines, apart from the exact answer: each upgrade setting at the size and policy of its own
    recommendation, then that recommendation and its command; or the one line on what small copies would save."""
    small = report.get("miss_copy")
    if not small:
        return []
    if not small["available"]:
        return [small["line"]]
    rec, exact = small["recommendation"], report["recommendation"]
    bits = f"Q{small['small_copy_bits']}_K " if small["small_copy_bits"] else ""
    out = [
        "",
        f"with --miss-copy ({small['label']}; {bits}small copies {small['small_copy_ratio']:.2f}x a blob), "
        f"{rec['policy']} {rec['cache_bytes'] / GIB:.2f} GiB:",
        f"  {'upgrade after':<15}{'MiB/token':>10}{'tok/s':>8}{'x exact':>9}{'upgrades/token':>16}"
        f"{'small hits/token':>18}",
    ]
    exact_tok_s = exact["predicted_decode_tokens_per_s"]
    for c in small["configs"]:
        if (c["policy"], c["cache_bytes"]) != (rec["policy"], rec["cache_bytes"]):
            continue
        tok_s = c["predicted_decode_tokens_per_s"]
        out.append(
            f"  {str(c['upgrade_after']):<15}{c['mib_read_per_token']:>10.1f}{_fmt(tok_s, '.2f'):>8}"
            f"{_fmt(tok_s / exact_tok_s if tok_s and exact_tok_s else None, '.2f'):>9}"
            f"{c['upgrades_per_token']:>16.2f}{c['small_hits_per_token']:>18.2f}"
        )
    vs = rec["vs_exact_recommendation_tokens_per_s"]
    slower = (
        " - predicted no faster than the exact recommendation: keep exact mode" if vs is not None and vs <= 1 else ""
    )
    out += [
        f"recommendation with --miss-copy ({small['label']}): {rec['policy']} {rec['cache_bytes'] / GIB:.2f} GiB, "
        f"--upgrade-after {rec['upgrade_after']}, predicted "
        f"{_fmt(rec['predicted_decode_tokens_per_s'], '.2f', 'unknown')} tok/s decode, "
        f"{rec['mib_read_per_token']:.1f} MiB/token"
        + (f", {vs:.2f}x the exact recommendation's tok/s" if vs is not None else "")
        + f" ({rec['reason']}){slower}",
        f"  {shlex.join(rec['command'])}",
        "",
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
