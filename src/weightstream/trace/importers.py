"""Importers for third-party routing dumps; each file is replayed in the order given, errors name file and line."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from weightstream.errors import WeightstreamError
from weightstream.trace.format import Trace, TraceWriter
from weightstream.trace.shapes import ModelShape

CSV_HEADER = ["Layer ID", "Batch Number", "Token", "Activated Expert IDs"]
JSONL_KEYS = ("problem_id", "layer", "experts", "token_idx")

# (layer -> (experts, weights)) for one token
Token = dict[int, tuple[list[int], list[float] | None]]


def _check_choice(where: str, shape: ModelShape, layer: int, experts: list[int]) -> None:
    if layer not in shape.layers:
        raise WeightstreamError(
            f"{where}: layer {layer} is not a routed layer of {shape.name!r} "
            f"(layers {shape.layers[0]}..{shape.layers[-1]}); wrong --model-shape?"
        )
    if len(experts) != shape.top_k:
        raise WeightstreamError(
            f"{where}: {len(experts)} experts chosen, shape {shape.name!r} has top-k "
            f"{shape.top_k}; wrong --model-shape?"
        )
    bad = [e for e in experts if not 0 <= e < shape.n_experts]
    if bad:
        raise WeightstreamError(
            f"{where}: expert {bad[0]} is outside 0..{shape.n_experts - 1} of {shape.name!r}; wrong --model-shape?"
        )


def _jsonl_record(where: str, line: str) -> dict:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as exc:  # not JSON, nested too deep, an integer of 4300+ digits
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise WeightstreamError(f"{where}: not a JSON object ({why}); the file may be truncated") from None
    if not isinstance(rec, dict) or any(k not in rec for k in JSONL_KEYS):
        raise WeightstreamError(f"{where}: record lacks one of {JSONL_KEYS}; is this a vLLM routing dump?")
    if not isinstance(rec["experts"], list) or not all(_integer(e) for e in rec["experts"]):
        raise WeightstreamError(f"{where}: 'experts' must be a list of integers, got {_shown(rec['experts'])}")
    for key in ("problem_id", "token_idx", "layer"):
        if not _integer(rec[key]):
            raise WeightstreamError(f"{where}: {key!r} must be an integer, got {_shown(rec[key])}")
    return rec


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _probability(value) -> bool:
    """A router weight a trace stores (a finite float32): others leave the dump's weights out, as a missing one does."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= 3.4e38


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_jsonl(path: Path, shape: ModelShape) -> dict[int, dict[int, Token]]:
    """problem id -> token index -> layer -> choice; a file that is not UTF-8 text is refused by name."""
    try:
        return _read_jsonl_lines(path, shape)
    except UnicodeDecodeError as exc:
        raise WeightstreamError(
            f"{path}: not UTF-8 text ({exc.reason}: {exc.object[exc.start]:#04x}); is this a vLLM routing dump?"
        ) from None


def _read_jsonl_lines(path: Path, shape: ModelShape) -> dict[int, dict[int, Token]]:
    """`_read_jsonl` of a file that decodes."""
    problems: dict[int, dict[int, Token]] = {}
    seen: dict[tuple[int, int, int], int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            rec = _jsonl_record(where, line)
            pid, tok, layer = rec["problem_id"], rec["token_idx"], rec["layer"]
            _check_choice(where, shape, layer, rec["experts"])
            if (pid, tok, layer) in seen:
                raise WeightstreamError(
                    f"{where}: problem {pid} token {tok} layer {layer} already given on line {seen[pid, tok, layer]}"
                )
            seen[pid, tok, layer] = lineno
            probs = rec.get("gating_probs")
            numbers = isinstance(probs, list) and all(_probability(p) for p in probs)
            weights = [float(p) for p in probs] if numbers and len(probs) == len(rec["experts"]) else None
            problems.setdefault(pid, {}).setdefault(tok, {})[layer] = (rec["experts"], weights)
    if not problems:
        raise WeightstreamError(f"{path}: no routing records (empty file); expected one JSON object per line")
    return problems


def import_vllm_jsonl(
    paths: Sequence[str | Path], shape: ModelShape, on_file: Callable[[Path], None] | None = None
) -> Trace:
    """vLLM routing dumps (one JSON record per token and layer); requests = (file, problem id), decode tokens."""
    files = []
    for p in paths:
        if on_file:
            on_file(Path(p))
        files.append((Path(p), _read_jsonl(Path(p), shape)))
    has_weights = all(
        w is not None
        for _, problems in files
        for toks in problems.values()
        for layers in toks.values()
        for _, w in layers.values()
    )
    writer = TraceWriter(shape, source=str(paths[0]) if len(paths) == 1 else "vllm-jsonl import")
    for path, problems in files:
        for pid in sorted(problems):
            for tok in sorted(problems[pid]):
                writer.begin_step(f"{path.name}:problem-{pid}", "decode", 1)
                for layer in sorted(problems[pid][tok]):
                    experts, weights = problems[pid][tok][layer]
                    writer.add(layer, experts, weights if has_weights else None)
    return writer.finish()


def _parse_experts(where: str, text: str) -> list[int]:
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        raise WeightstreamError(f"{where}: expert list {text!r} is not of the form [e1, e2, ...]")
    try:
        return [int(x) for x in body[1:-1].split(",") if x.strip()]
    except ValueError:
        raise WeightstreamError(f"{where}: expert list {text!r} holds a non-integer") from None


def _read_csv(path: Path, shape: ModelShape) -> dict[str, dict[int, list[list[int]]]]:
    """batch -> layer -> per-token expert lists, in file order; a file that is not UTF-8 text is refused by name."""
    try:
        return _read_csv_rows(path, shape)
    except UnicodeDecodeError as exc:
        raise WeightstreamError(
            f"{path}: not a UTF-8 CSV ({exc.reason}: {exc.object[exc.start]:#04x}); is this a moe-beyond CSV?"
        ) from None


def _read_csv_rows(path: Path, shape: ModelShape) -> dict[str, dict[int, list[list[int]]]]:
    """`_read_csv` of a file that decodes."""
    batches: dict[str, dict[int, list[list[int]]]] = {}
    # utf-8-sig: spreadsheets start their CSV exports with a byte-order mark (and end lines with CRLF, which the
    # csv module reads with newline="")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise WeightstreamError(f"{path}: empty file; expected a header {','.join(CSV_HEADER)} and rows")
        if [h.strip() for h in header] != CSV_HEADER:
            raise WeightstreamError(f"{path}:1: header {header} is not {CSV_HEADER}; is this a moe-beyond CSV?")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if len(row) != 4:
                raise WeightstreamError(f"{where}: {len(row)} fields, expected 4; the file may be truncated")
            try:
                layer = int(row[0])
            except ValueError:
                raise WeightstreamError(f"{where}: layer id {row[0]!r} is not an integer") from None
            experts = _parse_experts(where, row[3])
            _check_choice(where, shape, layer, experts)
            batches.setdefault(row[1].strip(), {}).setdefault(layer, []).append(experts)
    if not batches:
        raise WeightstreamError(f"{path}: header but no rows; the file is empty or truncated")
    return batches


def _token_count(path: Path, batch: str, layers: dict[int, list[list[int]]]) -> int:
    counts = {layer: len(tokens) for layer, tokens in layers.items()}
    if len(set(counts.values())) != 1:
        short = min(counts, key=counts.get)
        raise WeightstreamError(
            f"{path}: batch {batch}: layer {short} has {counts[short]} tokens but layer "
            f"{max(counts, key=counts.get)} has {max(counts.values())}; the file is truncated"
        )
    return next(iter(counts.values()))


def import_moe_beyond_csv(
    paths: Sequence[str | Path], shape: ModelShape, on_file: Callable[[Path], None] | None = None
) -> Trace:
    """moe-beyond CSVs (layer-major rows, one file per prompt), replayed token-major, one step per token."""
    writer = TraceWriter(shape, source=str(paths[0]) if len(paths) == 1 else "moe-beyond-csv import")
    for p in paths:
        path = Path(p)
        if on_file:
            on_file(path)
        for batch, layers in _read_csv(path, shape).items():
            request = path.name if batch == "0" else f"{path.name}#batch-{batch}"
            order = sorted(layers)
            for t in range(_token_count(path, batch, layers)):
                writer.begin_step(request, "prefill", 1)
                for layer in order:
                    writer.add(layer, layers[layer][t])
    return writer.finish()


IMPORTERS = {"vllm-jsonl": import_vllm_jsonl, "moe-beyond-csv": import_moe_beyond_csv}
