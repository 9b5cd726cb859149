"""The loaders the prefetch benchmark runs as commands; each prints one JSON line.

usage: python benchmarks/common/prefetch_loaders.py safetensors|transformers|runai|fastsafetensors MODEL_DIR
Every loader touches every byte it loads (a checksum of every tensor), so lazy (mmap) loading cannot hide I/O.
The checksum is a blake2b over (name, wrapping int64 sum of the tensor's bytes) in name order.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import threading
import time
from pathlib import Path

T0 = time.perf_counter()
import torch  # noqa: E402  (timed: imports are part of a server's start)


def tensor_sum(t: torch.Tensor) -> int:
    """Wrapping int64 sum of the tensor's raw bytes (reads every byte)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    n8 = raw.numel() // 8 * 8
    total = int(raw[:n8].view(torch.int64).sum()) if n8 else 0
    return total + int(raw[n8:].to(torch.int64).sum())


class Checksum:
    """Order-independent collection of per-tensor sums, digested in name order."""

    def __init__(self) -> None:
        self.sums: dict[str, int] = {}
        self.bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.sums[name] = tensor_sum(t)
        self.bytes += t.numel() * t.element_size()

    def hexdigest(self) -> str:
        d = hashlib.blake2b(digest_size=16)
        for name in sorted(self.sums):
            d.update(f"{name}={self.sums[name]};".encode())
        return d.hexdigest()


def shards(model: Path) -> list[str]:
    return sorted(str(p) for p in model.glob("*.safetensors"))


def load_safetensors(model: Path, ck: Checksum) -> None:
    from safetensors.torch import load_file

    for path in shards(model):
        for name, t in load_file(path).items():
            ck.add(name, t)


def load_transformers(model: Path, ck: Checksum) -> None:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    for name, t in m.state_dict().items():
        ck.add(name, t)


def load_runai(model: Path, ck: Checksum) -> None:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(shards(model))
        for name, t in streamer.get_tensors():
            ck.add(name, t)


def load_fastsafetensors(model: Path, ck: Checksum) -> None:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    loader.add_filenames({0: shards(model)})
    buffers = loader.copy_files_to_device()
    for name in loader.get_keys():
        ck.add(name, buffers.get_tensor(name))
    buffers.close()
    loader.close()


LOADERS = {
    "safetensors": load_safetensors,
    "transformers": load_transformers,
    "runai": load_runai,
    "fastsafetensors": load_fastsafetensors,
}


class PeakAnon:
    """Samples RssAnon every 10 ms: the memory the loader holds that is not page cache."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def main() -> None:
    name, model = sys.argv[1], Path(sys.argv[2])
    anon = PeakAnon()
    t1 = time.perf_counter()
    ck = Checksum()
    LOADERS[name](model, ck)
    t2 = time.perf_counter()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "loader": name,
                "import_s": round(t1 - T0, 3),
                "load_s": round(t2 - t1, 3),
                "checksum": ck.hexdigest(),
                "tensors": len(ck.sums),
                "bytes": ck.bytes,
                "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
                "peak_anon": anon.stop(),
            }
        )
    )


if __name__ == "__main__":
    main()
