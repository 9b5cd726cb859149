"""`import_gguf`: write the plan (planner.py) as a model directory, one dense tensor or one expert at a time, read
with pread, shards one per decoder layer as `weightstream quantize` writes them, built beside `--out` and renamed
into place when complete (store/outdir.py), the manifest written last. Every lossy step is measured and said."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from weightstream.errors import WeightstreamError
from weightstream.store.dtypes import torch_name
from weightstream.store.gguf.config import gguf_config
from weightstream.store.gguf.planner import Dense, Layer, activation_dtype, plan, scheme, tables
from weightstream.store.gguf.reader import FLOATS, GgufTensor, decode, ggml_kind, open_gguf, read_at, read_values
from weightstream.store.gguf.tokenizer import gguf_tokenizer
from weightstream.store.outdir import built_in_place, refuse_existing
from weightstream.store.quant.ggml_blocks import ENCODERS
from weightstream.store.quant.manifest import DTYPES, blob_key, row_bytes, write_manifest
from weightstream.store.safetensors_writer import write_shards

REQUANTIZE = ("auto", "q8_0", "q4_k")
_CHUNK = 16 * 2**20  # bytes of a dense tensor converted at a time


@dataclass(slots=True)
class _Loss:
    """A lossy conversion of some tensors: summed squared error and squared reference, worst tensor."""

    tensors: int = 0
    sse: float = 0.0
    ssr: float = 0.0
    worst: float = 0.0

    def add(self, sse: float, ssr: float) -> None:
        self.tensors += 1
        self.sse += sse
        self.ssr += ssr
        self.worst = max(self.worst, math.sqrt(sse / ssr) if ssr > 0 else 0.0)

    @property
    def rms(self) -> float:
        return math.sqrt(self.sse / self.ssr) if self.ssr > 0 else 0.0


@dataclass(slots=True)
class ImportResult:
    out_dir: str
    architecture: str  # the GGUF's
    model_type: str
    scheme: str | None  # None: the experts were floats, the directory is a plain checkpoint
    activation_dtype: str
    experts: int
    expert_types: dict[str, int]  # GGML type of the experts as stored in the output -> tensors (gate, up, down)
    dense_blocks: dict[str, int]  # GGML type -> dense linear weights kept as the file's blocks
    layer_tables: int  # layers whose blob table is their own
    requantized: list[dict]  # {"from", "to", "tensors", "rel_rms", "worst"}
    notes: list[str]
    total_bytes: int
    gguf_bytes: int
    seconds: float
    tokenizer: bool


def import_gguf(
    path: str,
    out: str,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    requantize: str = "auto",
    log: Callable[[str], None] | None = None,
) -> ImportResult:
    """Write `out`: the GGUF model at `path` as a model directory (config, tokenizer, dense safetensors, experts).

    `requantize` decides what expert types the native kernels cannot run become (auto: Q4_K for types of at most
    4.5 bits a weight, else Q8_0; or q8_0, or q4_k); the types they run are kept as they are. `log` receives
    every note on a lossy step or on what the model leaves out (default: stderr)."""
    start = time.perf_counter()
    log = log or (lambda line: print(f"weightstream import: {line}", file=sys.stderr))
    if requantize not in REQUANTIZE:
        raise WeightstreamError(f"--requantize {requantize!r}: choose one of {', '.join(REQUANTIZE)}")
    gf = open_gguf(path)
    refuse_existing(out, force, sources=gf.parts)
    arch, fields = gguf_config(gf)
    planned = plan(gf, arch, fields, requantize)
    config, dense, layers = planned.config, planned.dense, planned.layers
    dtype = activation_dtype(dense, layers)
    quant = None
    if layers[0].float_keys is None:
        source = {
            "gguf": os.path.basename(gf.path),
            "architecture": arch,
            "model_type": config.model_type,
            "expert_types": dict(Counter(t.type for lay in layers for t in lay.tensors.values())),
        }
        quant = tables(layers, scheme(layers), torch_name(dtype), source)
        blocks = {d.key: (d.block, d.shape) for d in dense if d.block}  # as `quantize --dense` lists them
        quant = dataclasses.replace(quant, dense=blocks or None)
    tokenizer, why = gguf_tokenizer(gf)
    losses: dict[tuple[str, str, str], _Loss] = {}
    notes = []
    needed = sum(
        math.prod(shape) * t.itemsize for item in [*dense, *layers] for t, shape in _specs(item, dtype).values()
    )
    with built_in_place(out, "import", note={"source": os.path.abspath(gf.path)}, needed=needed) as tmp:
        total = _write(gf, dense, layers, dtype, tmp, progress, losses)
        config.dtype = dtype
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if quant is not None:
            write_manifest(tmp, quant)  # last: without it the directory is not a quantized checkpoint
    notes += _loss_notes(losses)
    if why:
        notes.append(f"no tokenizer written ({why}); --prompt-ids works, text prompts need a tokenizer in {out}")
    notes += _dequantized_notes(dense, dtype)
    notes += planned.notes
    for line in notes:
        log(line)
    requantized = [
        {"from": k[1], "to": k[2], "tensors": v.tensors, "rel_rms": v.rms, "worst": v.worst}
        for k, v in sorted(losses.items())
        if k[0] == "experts"
    ]
    stored = Counter(
        k for lay in layers for p, k in (lay.targets or {p: t.type for p, t in lay.tensors.items()}).items()
    )
    return ImportResult(
        out,
        arch,
        config.model_type,
        quant.scheme if quant else None,
        torch_name(dtype),
        sum(m.tensors["gate"].shape[0] for m in layers),
        dict(stored),
        dict(sorted(Counter(d.block for d in dense if d.block).items())),
        len(quant.layer_tables or {}) if quant else 0,
        requantized,
        notes,
        total,
        gf.nbytes,
        time.perf_counter() - start,
        tokenizer is not None,
    )


def _dequantized_notes(dense: list[Dense], dtype: torch.dtype) -> list[str]:
    """One line per reason a dense tensor the file quantized is stored as floats (its error is said apart)."""
    why: dict[str, list[GgufTensor]] = {}
    for d in dense:
        if not d.block:
            why.setdefault(d.why_float, []).extend(t for t in d.parts if t.type not in FLOATS)
    lines = []
    for reason, tensors in why.items():
        if not tensors:
            continue
        kinds = Counter(t.type for t in tensors)
        names = ", ".join(t.name for t in tensors[:3]) + (" ..." if len(tensors) > 3 else "")
        lines.append(
            "dense weights: "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + f" tensor(s) dequantized to {torch_name(dtype)} ({names}): {reason}"
        )
    return lines


def _write(gf, dense: list[Dense], layers: list[Layer], dtype, out: str, progress, losses) -> int:
    """Shards by decoder layer (its dense tensors and its experts), as `weightstream quantize` writes them."""
    from weightstream.store.layout import layer_index

    shards: dict[int, list] = {}
    for d in dense:
        shards.setdefault(layer_index(d.key, -1), []).append(d)
    for lay in layers:
        shards.setdefault(lay.layer, []).append(lay)
    todo = sum(d.nbytes for d in dense) + sum(lay.nbytes for lay in layers)
    fds = {p: os.open(p, os.O_RDONLY) for p in gf.parts}
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(done, todo)

    def write_item(writer, item) -> None:
        if isinstance(item, Dense):
            if item.block:
                writer.write(item.key, _dense_blocks(item, fds))
            else:
                writer.write(item.key, _dense_tensor(item, item.dtype or dtype, fds, losses))
            advance(item.nbytes)
            return
        for e in range(item.tensors["gate"].shape[0]):
            for key, tensor in _expert(item, e, dtype, fds, losses):
                writer.write(key, tensor)
            advance(item.nbytes // item.tensors["gate"].shape[0])
        _close_expert_losses(item, losses)

    try:
        return write_shards(out, shards, lambda item: _specs(item, dtype), write_item)
    finally:
        for fd in fds.values():
            os.close(fd)


def _specs(item, dtype) -> dict:
    if isinstance(item, Dense) and item.block:  # (out, row bytes), as `quantize --dense` stores blocks
        return {item.key: (torch.uint8, (item.shape[0], row_bytes(item.block, item.shape[1])))}
    if isinstance(item, Dense):
        return {item.key: (item.dtype or dtype, item.shape)}
    n, inter, hidden = item.tensors["gate"].shape
    if item.float_keys is None:
        return {blob_key(item.path, e): (torch.uint8, (item.blob_bytes,)) for e in range(n)}
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return {key: (dtype, shapes[p]) for p, keys in item.float_keys.items() for key in keys}


def _dense_tensor(d: Dense, dtype: torch.dtype, fds, losses) -> torch.Tensor:
    """One dense tensor in `dtype`, converted a chunk of rows at a time; q/k rows put back in transformers' order;
    one joined from several tensors (their whole values, by the family's rule) at once."""
    if d.source is not None and d.source.build is not None:
        values = d.source.build([read_values(t, fds) for t in d.parts])
        out = values.to(dtype)
        if any(FLOATS.get(t.type) != dtype for t in d.parts):
            sse = float((out.double() - values.double()).pow(2).sum())
            losses.setdefault(("dense", d.tensor.type, torch_name(dtype)), _Loss()).add(
                sse, float(values.double().pow(2).sum())
            )
        return out.reshape(d.shape)
    t = d.tensor
    rows, row_bytes = t.rows, t.row_bytes
    k = t.shape[-1]
    out = torch.empty((rows, k), dtype=dtype)
    exact = FLOATS.get(t.type) == dtype
    sse = ssr = 0.0
    step = max(1, _CHUNK // max(row_bytes, 1))
    for r in range(0, rows, step):
        n = min(step, rows - r)
        raw = read_at(fds[t.path], t.path, t.offset + r * row_bytes, n * row_bytes)
        values = decode(raw, t.type, n, k)
        out[r : r + n] = values
        if not exact:
            sse += float((out[r : r + n].double() - values.double()).pow(2).sum())
            ssr += float(values.double().pow(2).sum())
    if not exact:
        losses.setdefault(("dense", t.type, torch_name(dtype)), _Loss()).add(sse, ssr)
    if d.permute_heads:
        out = _unpermute_rows(out, d.permute_heads)
    return out.reshape(d.shape)


def _dense_blocks(d: Dense, fds) -> torch.Tensor:
    """A dense linear weight's GGML blocks as the file stores them, uint8 (out, row bytes); q/k rows put back in
    transformers' order (whole rows of blocks moved: no value changes)."""
    t = d.tensor
    raw = torch.from_numpy(read_at(fds[t.path], t.path, t.offset, t.nbytes)).reshape(t.rows, t.row_bytes)
    return _unpermute_rows(raw, d.permute_heads) if d.permute_heads else raw


def _unpermute_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation of the rows of `x` (rows, anything): it stored row (head, half, i) of each
    head at (head, i, half). A float weight's rows or a block weight's rows of bytes alike."""
    rows, width = x.shape
    return x.reshape(heads, -1, 2, width).transpose(1, 2).reshape(rows, width).contiguous()


def _expert(lay: Layer, e: int, dtype, fds, losses):
    """(checkpoint key, tensor) of expert `e`: its blob, or its float tensors."""
    pieces = {}
    for proj, t in lay.tensors.items():
        per = t.nbytes // t.shape[0]
        pieces[proj] = read_at(fds[t.path], t.path, t.offset + e * per, per)
    if lay.float_keys is not None:
        for proj, t in lay.tensors.items():
            values = decode(pieces[proj], t.type, t.shape[1], t.shape[2])
            got = values.to(dtype)
            if FLOATS[t.type] != dtype:
                acc = losses.setdefault(("experts-float", t.type, torch_name(dtype), lay.layer, proj), _Loss())
                acc.sse += float((got.double() - values.double()).pow(2).sum())
                acc.ssr += float(values.double().pow(2).sum())
            yield lay.float_keys[proj][e], got
        return
    blob = np.zeros(lay.blob_bytes, dtype=np.uint8)
    table = {t.name: t for t in lay.table}
    for proj, t in lay.tensors.items():
        if lay.targets[proj] != t.type:
            pieces[proj] = _requantize(pieces[proj], t, lay.targets[proj], lay, proj, losses)
    rows = lay.tensors["gate"].shape[1]
    gate_up = _gate_up(pieces["gate"].reshape(rows, -1), pieces["up"].reshape(rows, -1), lay.interleaved)
    parts = {"gate_up_proj.qweight": gate_up.reshape(-1), "down_proj.qweight": pieces["down"]}
    if lay.biases:
        dtype = DTYPES[table["down_proj_bias"].dtype]  # the activation dtype
        stored = {}
        for proj, t in lay.biases.items():
            per = t.nbytes // t.shape[0]
            value = decode(read_at(fds[t.path], t.path, t.offset + e * per, per), t.type, 1, t.shape[1])[0]
            stored[proj] = value.to(dtype)
            if FLOATS.get(t.type) != dtype:
                acc = losses.setdefault(("expert-bias", t.type, torch_name(dtype), lay.layer, proj), _Loss())
                acc.sse += float((stored[proj].double() - value.double()).pow(2).sum())
                acc.ssr += float(value.double().pow(2).sum())
        parts["gate_up_proj_bias"] = _gate_up(stored["gate"], stored["up"], lay.interleaved).view(torch.uint8).numpy()
        parts["down_proj_bias"] = stored["down"].contiguous().view(torch.uint8).numpy()
    for name, data in parts.items():
        t = table[name]
        blob[t.offset : t.offset + t.nbytes] = data
    yield blob_key(lay.path, e), torch.from_numpy(blob)


def _gate_up(gate, up, interleaved: bool):
    """gate_up's rows (or bias values) from gate's and up's: gate's then up's, or alternating gate_i, up_i as
    gpt-oss's gate takes them (whole rows of blocks move: their bytes are the file's)."""
    if isinstance(gate, torch.Tensor):
        return torch.stack([gate, up], 1).reshape(-1, *gate.shape[1:]) if interleaved else torch.cat([gate, up])
    return np.stack([gate, up], 1).reshape(-1, *gate.shape[1:]) if interleaved else np.concatenate([gate, up])


def _requantize(raw: np.ndarray, t: GgufTensor, target: str, lay: Layer, proj: str, losses) -> np.ndarray:
    from gguf import quants

    rows, k = t.shape[1], t.shape[2]
    values = decode(raw, t.type, rows, k).float()
    encoded = ENCODERS[target](values)
    back = torch.from_numpy(quants.dequantize(encoded.numpy(), ggml_kind(target))).reshape(rows, k)
    acc = losses.setdefault(("expert-tensor", t.type, target, lay.layer, proj), _Loss())
    acc.sse += float((back.double() - values.double()).pow(2).sum())
    acc.ssr += float(values.double().pow(2).sum())
    return encoded.numpy().reshape(-1)


def _close_expert_losses(lay: Layer, losses) -> None:
    """Fold a layer's per-tensor sums (over its experts) into one entry per conversion."""
    for key in [k for k in losses if len(k) == 5 and k[3] == lay.layer]:
        acc = losses.pop(key)
        kind = {"expert-tensor": "experts", "expert-bias": "expert-biases"}.get(key[0], "experts-float")
        losses.setdefault((kind, key[1], key[2]), _Loss()).add(acc.sse, acc.ssr)


def _loss_notes(losses: dict) -> list[str]:
    lines = []
    for (kind, src, dst), acc in sorted(losses.items()):
        if acc.sse == 0:
            continue
        what = {
            "dense": f"dense weights: {acc.tensors} {src} tensor(s) stored as {dst}",
            "experts": f"experts: {acc.tensors} {src} tensor(s) requantized to {dst} (the native kernels do not run "
            f"{src})",
            "experts-float": f"experts: {acc.tensors} {src} tensor(s) stored as {dst}",
            "expert-biases": f"expert biases: {acc.tensors} {src} tensor(s) stored as {dst}",
        }[kind]
        lines.append(
            f"{what}: relative RMS error {acc.rms:.3%} against the GGUF's own values, {acc.worst:.3%} in the worst "
            "tensor"
        )
    return lines
