"""Proof for `weightstream tune`: its recommendation and predictions against `bench` measurements, judged against
the run-to-run spread of the same measurements.

Method. For each model, memory limit and routing (the model's own; DeepSeek-V2-Lite and Mixtral traces from
../shared/traces, replayed: cut into the steps the bench will run, each prompt's prefill then one token per step, and
the same file given to tune and bench):
1. `tune --calibrate --json`, timed. Every case calibrates anew, so that tune predicts for the machine of the minutes
   that follow.
2. `bench` of the recommended configuration and a grid around it (three of tune's cache sizes around it, and the
   largest size tune says loses to the page cache, x lru/slru/pinned; and the page cache with the whole expert
   budget), each run in its own memory cgroup at the limit, from a cold page cache: every configuration `--runs`
   times in rounds, each round in the reverse order of the one before (a drifting machine weighs on all alike); a
   configuration's figure is the median of its runs; then the ones within 5% of the best once more (`--repeats`).
3. With `--calibrate-each-round`, `tune --calibrate --forget-calibrations` again before every round after the first
   (the recorded routing reused), and each run is judged by the prediction of the calibration just before it: this
   machine's own speed moves by a third within one grid's 25 minutes.
4. Before calibration and before every run, a one-second CPU probe (`common/drift.py`: bf16 matrix-vector products,
   the shape of an MoE decode step) and a disk probe (one layer's top-k experts read as the engine's reader does:
   O_DIRECT, 4 I/O threads): how fast the machine itself was then.
Checks, per case: the recommendation within 5% of the best measured configuration, or tied with it inside the
spread of their runs; every prediction within 15% of its configuration's median; the page-cache-vs-expert-cache
call wherever the two differ by more than 10%; `tune --calibrate` under 2 minutes. The yardstick for the 15%: each
configuration's `spread`, (max - min) / median of its runs, recorded beside every prediction.

Prints one JSON object with the checks and writes it to --out after every case (a proof cut short keeps what it
measured). Needs root (bench's cgroups).

    .venv/bin/python benchmarks/tune_proof.py --model .work/bench-models/olmoe-16l-bf16 --limits 8GiB \\
        --routings own,mixtral --tokens 16 --context 512 --runs 3 --repeats 1 --gpt-oss-model "" \\
        --calibrate-each-round --out benchmarks/results/tune-proof-olmoe16-8gib.json

Two parts run by name instead:

    table      the Markdown tables of one or more reports (parts/tune_table.py)
    overhead   the runtime's memory beyond dense weights, expert cache and KV, which tune budgets as
               `RUNTIME_OVERHEAD_BYTES` (parts/tune_overhead.py)

    .venv/bin/python benchmarks/tune_proof.py table benchmarks/results/tune-proof-olmoe16-8gib.json
    .venv/bin/python benchmarks/tune_proof.py overhead MODEL_DIR [MODEL_DIR ...] --prompt-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import run_part
from common.drift import probe_workload
from common.drift import sample as probe_sample
from common.results import default
from common.results import save as save_result

from weightstream.bench.machine import block_device_of, machine_info
from weightstream.bench.prompts import tokenized_prompts
from weightstream.bench.runner import BenchConfig, run_bench
from weightstream.engine.loader import read_layout
from weightstream.engine.routing import layout_shape
from weightstream.sim.replay import Options, pinned_set
from weightstream.sim.workload import Workload
from weightstream.store.presets import preset_config
from weightstream.store.synth import synthesize
from weightstream.trace import load, resolve_shape, save
from weightstream.trace.importers import import_moe_beyond_csv, import_vllm_jsonl
from weightstream.trace.remap import onto_shape
from weightstream.units import MIB, parse_size

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
GRID_POLICIES = ("lru", "slru", "pinned")
TARGETS = {"recommendation_of_best": 0.95, "prediction_error": 0.15, "decision_margin": 0.10, "tune_s": 120.0}


def say(msg: str) -> None:
    print(f"[proof] {msg}", file=sys.stderr, flush=True)


def source_trace(name: str):
    if name == "deepseek":
        files = (TRACES / "deepseek-v2-lite-chat").glob("prompt_*_data.csv")
        files = sorted(files, key=lambda p: int(p.stem.split("_")[1]))
        return import_moe_beyond_csv(files, resolve_shape("deepseek-v2-lite"))
    files = [TRACES / "mixtral-8x7b-instruct" / f"{n}_routing.jsonl" for n in ("humaneval_2", "gsm8k_2")]
    return import_vllm_jsonl(files, resolve_shape("mixtral-8x7b"))


def bench_schedule(prompts: list[list[int]], tokens: int) -> list[tuple[str, str, int]]:
    """The steps a bench child runs: each prompt's prefill, then one token per decode step."""
    steps = []
    for i, ids in enumerate(prompts):
        steps += [(f"prompt-{i}", "prefill", len(ids))] + [(f"prompt-{i}", "decode", 1)] * (tokens - 1)
    return steps


def replay_file(model: str, routing: str, prompts, tokens: int, out: Path) -> str:
    """`routing`'s trace as the bench will replay it on `model`, saved for tune and bench alike."""
    _, layout = read_layout(model)
    trace = onto_shape(source_trace(routing), layout_shape(layout, "model"), bench_schedule(prompts, tokens))
    path = out / f"{Path(model).name}-{routing}-{tokens}.npz"
    save(trace, path)
    return str(path)


def run_tune(
    model: str, limit: str, routing: dict, args_in, calibrate: bool, forget: bool = False
) -> tuple[dict, float]:
    args = [sys.executable, "-m", "weightstream.cli", "tune", model, "--memory", limit]
    args += ["--max-new-tokens", str(args_in.tokens), "--context", str(args_in.context)]
    if routing["trace"]:
        args += ["--trace", routing["trace"]]
    elif routing["prompts"]:
        args += ["--prompts", routing["prompts"]]
    args += ["--calibrate", "--json"] if calibrate else ["--json"]
    args += ["--forget-calibrations"] if calibrate and forget else []
    start = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"tune failed: {r.stderr}")
    return json.loads(r.stdout), time.perf_counter() - start


def grid(report: dict, trace_path: str, out: Path) -> list[dict]:
    """The recommendation, three sizes around it x lru/slru/pinned (and the largest size tune says loses to the page
    cache), and the page cache."""
    expert = [c for c in report["configs"] if c["path"] == "expert-cache" and not c["bound"]]
    sizes = sorted({c["cache_bytes"] for c in expert})
    rec = report["recommendation"]
    i = sizes.index(rec["cache_bytes"]) if rec["path"] == "expert-cache" else len(sizes) - 1
    lo = max(0, min(i - 1, len(sizes) - 3))
    losing = report["page_cache_vs_expert_cache"].get("expert_cache_loses_up_to_bytes")
    chosen = {(p, s) for s in sizes[lo : lo + 3] + ([losing] if losing else []) for p in GRID_POLICIES}
    if rec["path"] == "expert-cache":
        chosen.add((rec["policy"], rec["cache_bytes"]))
    w = Workload(load(trace_path), 0.0)
    configs = []
    for policy, size in sorted(chosen, key=lambda t: (t[1], t[0])):
        c = next(c for c in expert if (c["policy"], c["cache_bytes"]) == (policy, size))
        entry = {"path": "expert-cache", "policy": policy, "cache_bytes": size, "predicted": c}
        entry["recommended"] = rec["path"] == "expert-cache" and (policy, size) == (rec["policy"], rec["cache_bytes"])
        if policy == "pinned":
            entry["pinned_experts"] = str(out / f"pinned-{Path(trace_path).stem}-{c['slots']}.json")
            keys = pinned_set(w, c["slots"], Options())
            Path(entry["pinned_experts"]).write_text(json.dumps({"pinned_experts": [list(k) for k in keys]}))
        configs.append(entry)
    page = next(c for c in report["configs"] if c["path"] == "page-cache")
    page_entry = {"path": "page-cache", "policy": "kernel", "cache_bytes": page["cache_bytes"], "predicted": page}
    return configs + [page_entry | {"recommended": rec["path"] == "page-cache"}]


PROBE = {}


def probe() -> float:
    """Passes per second of the fixed decode-like workload over one second: the machine's speed now."""
    if not PROBE:
        PROBE["weights"], PROBE["x"] = probe_workload(256)
    return probe_sample(PROBE["weights"], PROBE["x"], 1.0)["passes_per_s"]


DISK = {}


def disk_probe(model: str) -> float:
    """Milliseconds per MiB for the engine's reader to land one layer's top-k experts (the next layer each call,
    cycling: calibration's repeated reads found no disk cache here), into scratch touched once before, as a warm
    cache's slots are (a first read into fresh memory also pays its page faults): the disk's speed now."""
    from weightstream.bench.read_timing import ExpertReads

    if model not in DISK:
        _, layout = read_layout(model)
        reads = ExpertReads(layout, 4, None, max_batch=layout.top_k)
        reads.land([(layout.layers[0], e) for e in range(layout.top_k, 2 * layout.top_k)])  # touches the scratch
        DISK[model] = {"layout": layout, "reads": reads, "calls": 0}
    state = DISK[model]
    layout = state["layout"]
    layer = layout.layers[state["calls"] % len(layout.layers)]
    state["calls"] += 1
    seconds, nbytes = state["reads"].land([(layer, e) for e in range(layout.top_k)])
    return 1e3 * seconds / (nbytes / MIB)


def measure(model: str, limit: int, prompts, tokens: int, trace: str | None, entry: dict) -> dict:
    """One bench run of one configuration: its own cgroup at the limit, cold page cache; the probes just before."""
    speed, disk = probe(), disk_probe(model)
    config = BenchConfig(
        model_dir=model,
        memory_limit=limit,
        expert_caches=[str(entry["cache_bytes"])],
        modes=[entry["path"]],
        prompts=prompts,
        max_new_tokens=tokens,
        routing_trace=trace,
        reference=False,
        overlap=False,
        policy=entry["policy"] if entry["path"] == "expert-cache" else "lru",
        pinned_experts=entry.get("pinned_experts"),
    )
    run = run_bench(config, progress=lambda m: None)["runs"][0]
    full = all(len(ids) == tokens for ids in run.get("token_ids", []))  # an early EOS would shift replayed rows
    keep = ("decode_tokens_per_s", "expert_hit_rate", "decode_bytes_read_per_token")
    keep += ("cgroup_peak_bytes", "cgroup_pressure", "error")
    return {
        **{k: run.get(k) for k in keep},
        "all_tokens_generated": full,
        "probe_passes_per_s": speed,
        "disk_ms_per_mib": disk,
    }


def measure_grid(args, model, limit, prompts, trace, configs, retune=None) -> None:
    """Every configuration `args.runs` times in rounds, each round in the reverse order of the one before; then
    the ones within 5% of the best again. With `retune` (a fresh `tune --calibrate` before every round after the
    first), each run keeps the prediction of the calibration just before it, and a configuration's prediction
    becomes the median of its runs'."""

    def run_once(entry: dict) -> None:  # a run, with the prediction it is judged by
        run = measure(model, limit, prompts, args.tokens, trace, entry)
        entry["runs"].append(run | {"predicted": entry["predicted"]["predicted_decode_tokens_per_s"]})

    for entry in configs:
        entry["runs"] = []
    for round_ in range(args.runs):
        if retune and round_:
            report = retune()
            for entry in configs:
                entry["predicted"] = _same_config(report, entry)
        for entry in configs if round_ % 2 == 0 else configs[::-1]:
            say(f"  bench {entry['path']} {entry['policy']} {entry['cache_bytes'] / 2**30:.2f} GiB, run {round_ + 1}")
            run_once(entry)
    for _ in range(args.repeats):
        best = max(_speed(e) for e in configs)
        for entry in configs:
            if _speed(entry) >= (1 - 0.05) * best:
                run_once(entry)
    for entry in configs:
        speeds = [r["decode_tokens_per_s"] for r in entry["runs"] if not r.get("error")]
        entry["measured"] = statistics.median(speeds) if speeds else None
        entry["spread"] = (max(speeds) - min(speeds)) / statistics.median(speeds) if len(speeds) > 1 else 0.0
        if retune:
            predicted = statistics.median(r["predicted"] for r in entry["runs"] if not r.get("error"))
            entry["predicted"] = entry["predicted"] | {"predicted_decode_tokens_per_s": predicted}


def _same_config(report: dict, entry: dict) -> dict:
    """`entry`'s configuration in another tune report of the same case (its cache sizes depend on the budget
    alone, so they recur; the nearest size of the same policy where one does not)."""
    same = [c for c in report["configs"] if c["path"] == entry["path"] and not c.get("bound")]
    if entry["path"] == "expert-cache":
        same = [c for c in same if c["policy"] == entry["policy"]]
    return min(same, key=lambda c: abs(c["cache_bytes"] - entry["cache_bytes"]))


def _speed(entry: dict) -> float:
    speeds = [r["decode_tokens_per_s"] for r in entry["runs"] if not r.get("error")]
    return statistics.median(speeds) if speeds else 0.0


def check(report: dict, configs: list[dict], tune_s: float | None) -> dict:
    """The issue's targets for one (model, limit, routing)."""
    ok = [c for c in configs if c.get("measured")]
    best = max(ok, key=lambda c: c["measured"])
    mine = next(c for c in ok if c.get("recommended"))
    tie = abs(best["measured"] - mine["measured"]) <= max(best["spread"], mine["spread"]) * best["measured"]
    errors = {_name(c): c["predicted"]["predicted_decode_tokens_per_s"] / c["measured"] - 1 for c in ok}
    page = next(c for c in ok if c["path"] == "page-cache")
    expert = [c for c in ok if c["path"] == "expert-cache"]
    ratio = max(c["measured"] for c in expert) / page["measured"]
    margin = TARGETS["decision_margin"]
    measured_winner = "tie" if abs(ratio - 1) <= margin else ("expert-cache" if ratio > 1 else "page-cache")
    verdict = report["page_cache_vs_expert_cache"]
    loses_up_to = verdict.get("expert_cache_loses_up_to_bytes")
    return {
        "recommendation_of_best": mine["measured"] / best["measured"],
        "recommendation_ok": mine["measured"] >= TARGETS["recommendation_of_best"] * best["measured"] or tie,
        "prediction_errors": errors,
        "predictions_ok": all(abs(e) <= TARGETS["prediction_error"] for e in errors.values()),
        "measured_expert_over_page": ratio,
        "decision_ok": measured_winner == "tie" or verdict["winner"] == measured_winner,
        "tune_s": tune_s,
        "tune_time_ok": tune_s is None or tune_s < TARGETS["tune_s"],
        "tune_says_expert_cache_loses": verdict["winner"] == "page-cache" or loses_up_to is not None,
        "measured_sizes_losing_to_page_cache": sorted(
            {c["cache_bytes"] for c in expert if _best_measured(expert, c["cache_bytes"]) < page["measured"]}
        ),
        "predicted_losing_up_to_bytes": loses_up_to,
    }


def _name(c: dict) -> str:
    return f"{c['path']} {c['policy']} {c['cache_bytes']}"


def _best_measured(expert: list[dict], size: int) -> float:
    return max(c["measured"] for c in expert if c["cache_bytes"] == size)


def case(args, model: str, limit: str, routing: str, first: bool, out: Path) -> dict:
    say(f"{Path(model).name} at {limit}, routing {routing}")
    prompts = tokenized_prompts(model, args.prompts)
    if routing == "own":
        spec = {"trace": None, "prompts": args.prompts}
    else:
        spec = {"trace": replay_file(model, routing, prompts, args.tokens, out), "prompts": None}
    each_round = args.calibrate_each_round
    probe_before, disk_before = probe(), disk_probe(model)
    report, tune_s = run_tune(model, limit, spec, args, calibrate=first or args.calibrate_each, forget=each_round)
    probe_after, disk_after = probe(), disk_probe(model)
    trace = spec["trace"] or report["routing"]["saved_to"]
    configs = grid(report, trace, out)
    retunes = []

    def retune() -> dict:  # the same routing (the recorded one: not recorded again), a fresh calibration alone
        say("  tune --calibrate --forget-calibrations before the next round")
        again, seconds = run_tune(model, limit, {"trace": trace, "prompts": None}, args, True, forget=True)
        retunes.append({"tune_s": seconds, "params": again["calibration"].get("params")})
        return again

    measure_grid(args, model, parse_size(limit), prompts, spec["trace"], configs, retune if each_round else None)
    grid_out = []
    for c in configs:
        predicted = {"predicted_decode_tokens_per_s": c["predicted"]["predicted_decode_tokens_per_s"]}
        grid_out.append({k: v for k, v in c.items() if k != "predicted"} | predicted)
    return {
        "model": model,
        "limit": limit,
        "routing": routing,
        "tune": {k: report[k] for k in ("budget", "recommendation", "page_cache_vs_expert_cache", "timings_s")},
        "calibration": report["calibration"].get("params"),
        # how many of this machine's saved calibrations the params are the median of (1 before they added up)
        "calibration_samples": report["calibration"].get("samples", 1),
        "calibration_spread": report["calibration"].get("spread"),
        "calibrations_before_later_rounds": retunes,
        "grid": grid_out,
        "checks": check(report, configs, tune_s if first or args.calibrate_each else None),
        "probe": _probe_summary(probe_before, probe_after, configs),
        "disk_probe": _probe_summary(disk_before, disk_after, configs, "ms_per_mib"),
    }


def _probe_summary(before: float, after: float, configs: list[dict], unit: str = "passes_per_s") -> dict:
    """A probe at calibration (around tune) and at each bench run, and how far it moved (the CPU's in passes per
    second, the disk's in ms per MiB)."""
    at_calibration = (before + after) / 2
    field = "probe_passes_per_s" if unit == "passes_per_s" else "disk_ms_per_mib"
    runs = [r[field] for c in configs for r in c["runs"]]
    return {
        f"at_calibration_{unit}": [before, after],
        f"at_runs_{unit}": {"median": statistics.median(runs), "min": min(runs), "max": max(runs)},
        "runs_over_calibration": {
            "median": statistics.median(runs) / at_calibration,
            "min": min(runs) / at_calibration,
            "max": max(runs) / at_calibration,
        },
    }


def gpt_oss_model(path: str, layers: int) -> str:
    """A gpt-oss-20b-shaped checkpoint (few large experts), written once."""
    if not os.path.exists(os.path.join(path, "config.json")):
        say(f"writing {path} (gpt-oss-20b shape, {layers} layers, bf16)")
        synthesize(path, preset_config("gpt-oss-20b", layers=layers), "bf16", seed=0)
    return path


def main() -> None:
    if run_part("tune_proof.py", {"table": "tune_table", "overhead": "tune_overhead"}):
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--limits", default="3GiB,5GiB,8GiB")
    p.add_argument("--routings", default="own,deepseek,mixtral")
    p.add_argument("--prompts", help="prompts file for the model's own routing and the bench (default: built-in)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="tune's KV budget: the bench's prompts are short")
    p.add_argument("--runs", type=int, default=2, help="runs of every configuration, in rounds (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="extra runs of the configurations within 5%% of the best")
    p.add_argument(
        "--calibrate-once",
        dest="calibrate_each",
        action="store_false",
        help="calibrate only in each model's first case (default: every case, just before its grid)",
    )
    p.add_argument(
        "--calibrate-each-round",
        action="store_true",
        help="run `tune --calibrate --forget-calibrations` before every round, each run judged by the prediction "
        "of the calibration just before it (on a machine whose speed moves within the proof's minutes)",
    )
    p.add_argument("--gpt-oss-model", help="where the gpt-oss-shaped case lives (written if missing); '' skips it")
    p.add_argument("--gpt-oss-layers", type=int, default=4)
    p.add_argument("--gpt-oss-limits", default="4GiB,5GiB")
    p.add_argument("--gpt-oss-first", action="store_true", help="run the gpt-oss-shaped cases before the others")
    p.add_argument("--out", default=default("tune-proof.json"), help="result file (default: %(default)s)")
    args = p.parse_args()
    work = Path(".work/tune-proof")  # replay traces and pinned sets: scratch, never beside the report
    work.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine_info(block_device_of(args.model)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "command": " ".join(sys.argv),
        "targets": TARGETS,
        "cases": [],
    }

    def run_case(*case_args, **extra) -> None:
        try:
            report["cases"].append(case(args, *case_args) | extra)
        except (Exception, SystemExit) as exc:  # one case's failure is reported, the others still run
            model, limit, routing = case_args[:3]
            say(f"  failed: {exc}")
            report["cases"].append({"model": model, "limit": limit, "routing": routing, "error": str(exc)} | extra)
        save_result(json.dumps(report, indent=1), args.out)  # after every case: a proof cut short keeps its runs

    def run_gpt_oss() -> None:
        model = gpt_oss_model(args.gpt_oss_model, args.gpt_oss_layers)
        for i, limit in enumerate(args.gpt_oss_limits.split(",")):
            run_case(model, limit, "own", i == 0, work, expert_cache_should_lose=True)

    if args.gpt_oss_first and args.gpt_oss_model:
        run_gpt_oss()
    for i, (limit, routing) in enumerate((lim, r) for lim in args.limits.split(",") for r in args.routings.split(",")):
        run_case(args.model, limit, routing, i == 0, work)
    if args.gpt_oss_model and not args.gpt_oss_first:
        run_gpt_oss()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
