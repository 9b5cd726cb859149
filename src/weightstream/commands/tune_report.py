"""`weightstream tune`'s answer printed: its table and lines, `--json`, the plot (the answer itself: tune/report.py)."""

from __future__ import annotations

import json
import shlex

from weightstream.units import format_bytes


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(report: dict) -> list[str]:
    ws = report["budget"]["working_set_bytes"]
    rec = report["recommendation"]
    lines = [
        f"{'':2}{'path':<13}{'policy':<19}{'cache':>12}{'x WS':>8}{'hit rate':>9}{'MiB/token':>10}"
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
            f"{format_bytes(c['cache_bytes']):>12}{c['cache_bytes'] / ws:>8.2f}{c['hit_rate']:>9.1%}"
            f"{c['mib_read_per_token']:>10.1f}{_fmt(c['predicted_decode_tokens_per_s'], '.2f'):>8}"
            f"{_fmt(c['predicted_prefill_s'], '.2f'):>10}{_fmt(c.get('of_belady_tokens_per_s'), '.2f'):>10}"
        )
    return lines


def text(report: dict) -> list[str]:
    b, r, rec = report["budget"], report["routing"], report["recommendation"]
    out = [
        f"model {report['model']}: memory {format_bytes(b['memory_bytes'])} = dense "
        f"{format_bytes(b['resident_dense_bytes'])} + "
        f"KV ({b['context_tokens']} tokens) {format_bytes(b['kv_cache_bytes'])} + runtime "
        f"{format_bytes(b['runtime_overhead_bytes'])} + experts {format_bytes(b['expert_bytes'])} "
        f"(one token's working set {format_bytes(b['working_set_bytes'])})"
        + (
            f"; the input embedding's {format_bytes(b['lazy_dense_bytes'])} stays on disk (mmap reads only the rows "
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
        f"recommendation: {rec['path']} {rec['policy']} {format_bytes(rec['cache_bytes'])}, predicted "
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
        f"{rec['policy']} {format_bytes(rec['cache_bytes'])}:",
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
        f"recommendation with --miss-copy ({small['label']}): {rec['policy']} {format_bytes(rec['cache_bytes'])}, "
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
