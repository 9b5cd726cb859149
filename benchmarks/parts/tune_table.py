"""The Markdown tables of a `tune_proof.py` report (docs/benchmarks.md, "tune").

    .venv/bin/python benchmarks/tune_proof.py table benchmarks/results/tune-proof-olmoe16-8gib.json [more.json ...]

Per case: what tune said, each configuration's prediction against the median of its runs (every run listed, with
the machine probe's passes per second before it), the checks, and how far the machine moved from calibration.
Then one summary line over every case read.
"""

from __future__ import annotations

import argparse
import json
import statistics


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def case_table(c: dict) -> tuple[list[str], dict]:
    name = c["model"].rstrip("/").split("/")[-1]
    if "error" in c:
        return [f"#### {name}, {c['limit']}, routing {c['routing']}", f"failed: {c['error']}", ""], {}
    rec = c["tune"]["recommendation"]
    verdict = c["tune"]["page_cache_vs_expert_cache"]
    lines = [f"#### {name}, {c['limit']}, routing {c['routing']}"]
    said = f"tune: {rec['path']} {rec.get('policy') or ''} {gib(rec['cache_bytes'])}".replace("  ", " ")
    loses = verdict.get("expert_cache_loses_up_to_bytes")
    lines.append(
        f"{said}, predicted {rec['predicted_decode_tokens_per_s']:.2f} tok/s; verdict: {verdict['winner']}"
        + (f"; an expert cache of {gib(loses)} or less loses to the page cache" if loses else "")
        + (
            f"; priced with the median of {c['calibration_samples']} calibrations"
            if c.get("calibration_samples", 1) > 1
            else ""
        )
    )
    lines += [
        "",
        "| configuration | predicted tok/s | measured tok/s (runs) | error | probe before each run (CPU passes/s"
        + (" / disk ms per MiB)" if c.get("disk_probe") else ")")
        + " |",
        "|---|---|---|---|---|",
    ]
    errors = []
    for g in c["grid"]:
        runs = [r for r in g["runs"] if not r.get("error")]
        speeds = ", ".join(f"{r['decode_tokens_per_s']:.2f}" for r in runs)
        probes = ", ".join(
            f"{r.get('probe_passes_per_s', float('nan')):.1f}"
            + (f" / {r['disk_ms_per_mib']:.2f}" if r.get("disk_ms_per_mib") is not None else "")
            for r in runs
        )
        predicted = f"{g['predicted_decode_tokens_per_s']:.2f}"
        if len({r.get("predicted") for r in runs}) > 1:  # a calibration before every round: each run's own
            predicted += " (" + ", ".join(f"{r['predicted']:.2f}" for r in runs) + ")"
        label = f"{g['path']} {g['policy']} {gib(g['cache_bytes'])}"
        label += " **(recommended)**" if g["recommended"] else ""
        if not g.get("measured"):
            lines.append(f"| {label} | {predicted} | no run succeeded | - | {probes} |")
            continue
        err = g["predicted_decode_tokens_per_s"] / g["measured"] - 1
        errors.append(err)
        lines.append(f"| {label} | {predicted} | {g['measured']:.2f} ({speeds}) | {err:+.0%} | {probes} |")
    ch = c["checks"]
    within = sum(abs(e) <= 0.15 for e in errors)
    probe = c.get("probe", {})
    moved = probe.get("runs_over_calibration", {})
    lines += [
        "",
        f"checks: recommendation {ch['recommendation_of_best']:.3f} of the best measured "
        f"(ok={ch['recommendation_ok']}); "
        f"predictions within 15%: {within} of {len(errors)} ({min(errors):+.0%} to {max(errors):+.0%}); measured "
        f"expert/page {ch['measured_expert_over_page']:.2f}x, decision ok={ch['decision_ok']}; "
        + (f"tune --calibrate {ch['tune_s']:.0f} s" if ch.get("tune_s") else "tune reused a calibration")
        + (
            f"; machine probe at the runs / at calibration: median {moved['median']:.2f}, "
            f"{moved['min']:.2f} to {moved['max']:.2f}"
            if moved
            else ""
        )
        + (
            f"; disk probe at the runs / at calibration (ms per MiB, {disk[0]:.2f} at calibration): median "
            f"{disk[1]['median']:.2f}, {disk[1]['min']:.2f} to {disk[1]['max']:.2f}"
            if (disk := _disk(c))
            else ""
        ),
        "",
    ]
    summary = {
        "within": within,
        "predictions": len(errors),
        "rec_ok": ch["recommendation_ok"],
        "decision_ok": ch["decision_ok"],
        "tune_s": ch.get("tune_s"),
        "page_error": next(
            (e for g, e in zip([g for g in c["grid"] if g.get("measured")], errors) if g["path"] == "page-cache"),
            None,
        ),
    }
    return lines, summary


def _times(times: list[float]) -> str:
    return f", tune --calibrate {min(times):.0f}-{max(times):.0f} s (median {statistics.median(times):.0f})"


def _disk(case: dict):
    """(disk ms per MiB at calibration, the runs' ratios to it) where the case has a disk probe."""
    d = case.get("disk_probe")
    if not d:
        return None
    return statistics.mean(d["at_calibration_ms_per_mib"]), d["runs_over_calibration"]


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+")
    args = p.parse_args(argv)
    summaries = []
    for path in args.reports:
        with open(path) as f:
            report = json.load(f)
        print(f"From `{path}` ({report['date']}, commit {report['commit']}):\n")
        for c in report["cases"]:
            lines, summary = case_table(c)
            print("\n".join(lines))
            if summary:
                summaries.append(summary)
    if summaries:
        times = [s["tune_s"] for s in summaries if s["tune_s"]]
        pages = [s["page_error"] for s in summaries if s["page_error"] is not None]
        print(
            f"Over {len(summaries)} cases: recommendation ok {sum(s['rec_ok'] for s in summaries)}, decision ok "
            f"{sum(s['decision_ok'] for s in summaries)}, predictions within 15% "
            f"{sum(s['within'] for s in summaries)} of {sum(s['predictions'] for s in summaries)}"
            + (_times(times) if times else "")
            + (f", page-cache errors {min(pages):+.0%} to {max(pages):+.0%}" if pages else "")
        )
