"""Concurrent clients, a free port and a server child's readiness: what the serving benchmarks (`serve_bench.py
concurrency` and `ray`, `llamacpp.py serve`, `gguf_import.py quality`) share."""

from __future__ import annotations

import queue
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_clients(items: list, clients: int, work: Callable) -> tuple[list, float]:
    """work(item) for every item, `clients` threads at a time, each taking the next item when it is done: the
    results (in the order they finished) and the wall time of the whole. An exception in `work` is re-raised here
    after every thread has stopped."""
    todo: queue.Queue = queue.Queue()
    for item in items:
        todo.put(item)
    results: list = []
    failures: list[BaseException] = []

    def client() -> None:
        while not failures:
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results.append(work(item))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
                failures.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return results, time.perf_counter() - start


def stderr_lines(proc: subprocess.Popen) -> list[str]:
    """The lines `proc` writes to its stderr (a pipe), gathered by a thread as they come."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return lines


def wait_ready(proc: subprocess.Popen, lines: list[str], url: str | None = None, timeout: float = 1800) -> str | None:
    """The server's URL once its /health answers 200: `url`, or where its stderr says it listens (`weightstream
    serve --port 0`); None if it exited or did not answer within `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if url is None:
            found = re.search(r"listening on (http://\S+?);", "".join(lines))
            url = found.group(1) if found else None
        try:
            if url and httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return None
