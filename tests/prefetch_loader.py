"""A small real loader for the prefetch tests: reads weight files and prints a digest of every byte it saw.

usage: python prefetch_loader.py MODE [--sleep-per-mib S] [--exit N] FILE...
MODE: read (pread, 1 MiB at a time), mmap (touch through a mapping), safetensors (load_file, every tensor).
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import sys
import time

MIB = 1 << 20


def _read(path: str, sleep: float) -> str:
    digest = hashlib.blake2b(digest_size=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while chunk := os.pread(fd, MIB, offset):
            digest.update(chunk)
            offset += len(chunk)
            time.sleep(sleep)
    finally:
        os.close(fd)
    return digest.hexdigest()


HELD: list[mmap.mmap] = []  # --hold: mappings kept until exit, as a loader whose tensors are the mapping


def _mmap(path: str, sleep: float, hold: bool = False) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    for offset in range(0, len(m), MIB):
        digest.update(m[offset : offset + MIB])
        time.sleep(sleep)
    HELD.append(m) if hold else m.close()
    return digest.hexdigest()


def _safetensors(path: str, sleep: float) -> str:
    import torch
    from safetensors.torch import load_file

    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(load_file(path).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        time.sleep(sleep * tensor.nbytes / MIB)
    return digest.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("read", "mmap", "safetensors"))
    p.add_argument("files", nargs="+")
    p.add_argument("--sleep-per-mib", type=float, default=0.0)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--passes", type=int, default=1, help="read everything this many times")
    p.add_argument("--hold", action="store_true", help="mmap: keep the mappings until exit")
    p.add_argument("--linger", type=float, default=0.0, help="seconds to wait before exiting (after loading)")
    args = p.parse_args()
    load = {"read": _read, "mmap": lambda p, s: _mmap(p, s, args.hold), "safetensors": _safetensors}[args.mode]
    for _ in range(args.passes):
        for path in args.files:
            print(os.path.basename(path), load(path, args.sleep_per_mib), flush=True)
    print("loader done", file=sys.stderr)
    time.sleep(args.linger)
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
