"""Converting a published FP8 / MXFP4 checkpoint into the directory it runs through: an explicit step, apart from
reading it (store/published.py reads; `map_model` maps a fresh copy and never writes one).

The engine's loader takes this step for the user, saying so on stderr: the first run of such a checkpoint writes
its experts beside it (MXFP4 as GGML MXFP4 blocks, lossless; FP8 as BF16 rows of the dequantized weights) under
MODEL/.weightstream, once, and every later run (any process) maps that copy while the published files are
unchanged. One conversion at a time per checkpoint (a file lock); the disk's free space is checked first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys

from weightstream import native
from weightstream.errors import WeightstreamError
from weightstream.progress import byte_progress
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.published import Published, copy_path, fresh_copy, read_published
from weightstream.store.quant.pipeline import quantize_checkpoint


def runnable_dir(model_dir: str) -> str:
    """The directory that runs for `model_dir`: itself, or for a published FP8 / MXFP4 checkpoint its converted
    copy (`converted_dir`)."""
    published = read_published(open_checkpoint(model_dir))
    return model_dir if published is None else converted_dir(published)


def converted_dir(published: Published) -> str:
    """The quantized-experts directory a published checkpoint runs through, written beside it the first time (and
    again when its files changed); one line on stderr says which, every time."""
    model_dir = published.model_dir
    out = copy_path(published)
    kept = "experts as GGML MXFP4 blocks (lossless)"
    if published.kind == "fp8":
        kept = "experts as BF16 rows (the weights as dequantized), dense FP8 weights dequantized to bfloat16"
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with _locked(out + ".lock"):
            if fresh_copy(published) == out:
                _say(f"{model_dir} is {published.describe()}: running {out} ({kept}), converted earlier")
                return out
            if not native.available():
                raise WeightstreamError(
                    f"{model_dir} is {published.describe()}, which runs on weightstream's native kernels, not "
                    f"available here ({native.why_not()})"
                )
            _check_space(published, out)
            _say(f"{model_dir} is {published.describe()}: converting it once into {out} ({kept}); reused next time")
            bits = 4 if published.kind == "mxfp4" else 16
            try:
                with byte_progress(f"converting {model_dir}") as progress:
                    quantize_checkpoint(model_dir, out, bits, force=True, progress=progress, kernel="native")
            except WeightstreamError as exc:
                raise WeightstreamError(
                    f"{model_dir} is {published.describe()}; converting it for the native kernels failed: {exc}"
                ) from None
    except OSError as exc:
        raise WeightstreamError(
            f"{model_dir} is {published.describe()} and runs through a copy converted beside it, but {out} cannot be "
            f"written ({exc.strerror}); make the directory writable, or convert it elsewhere with `weightstream "
            f"quantize {model_dir} --bits {4 if published.kind == 'mxfp4' else 16} --out DIR` and run DIR"
        ) from None
    return out


def _check_space(published: Published, out: str) -> None:
    """Refuse, before writing, a conversion the disk cannot hold (FP8 experts double: BF16 rows)."""
    stored = published.source.total_bytes()
    need = 2 * stored if published.kind == "fp8" else stored
    free = shutil.disk_usage(os.path.dirname(out)).free
    if free < need:
        raise WeightstreamError(
            f"{published.model_dir} is {published.describe()}; running it as it is writes a converted copy of about "
            f"{need / 2**30:.1f} GiB to {out}, and {free / 2**30:.1f} GiB are free there. Free space, or write a "
            f"smaller copy elsewhere: `weightstream quantize {published.model_dir} --bits 8 --out DIR`"
        )


@contextlib.contextmanager
def _locked(path: str):
    """One conversion at a time per checkpoint (two `generate`s started together convert once)."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _say(line: str) -> None:
    print(f"weightstream: {line}", file=sys.stderr)
