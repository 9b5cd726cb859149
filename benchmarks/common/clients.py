"""Concurrent clients and a free port: what the serving benchmarks (serve_concurrency, serve_vs_llamacpp, serve_ray)
share."""

from __future__ import annotations

import queue
import socket
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
