"""Compiled LFU and Belady replays on an indexed binary min-heap of resident keys (see kernels.py for inputs)."""

from __future__ import annotations

import numpy as np

from weightstream.sim.kernels import njit

FREQ_SHIFT = 40  # LFU rank = (count << 40) | tick of last access: lowest count first, then least recent


@njit(cache=True)
def _sift_up(h, pos, prio, j):
    k = h[j]
    while j > 0:
        p = (j - 1) >> 1
        if prio[h[p]] <= prio[k]:
            break
        h[j] = h[p]
        pos[h[j]] = j
        j = p
    h[j] = k
    pos[k] = j


@njit(cache=True)
def _sift_down(h, pos, prio, j, n):
    k = h[j]
    while True:
        c = 2 * j + 1
        if c >= n:
            break
        if c + 1 < n and prio[h[c + 1]] < prio[h[c]]:
            c += 1
        if prio[h[c]] >= prio[k]:
            break
        h[j] = h[c]
        pos[h[j]] = j
        j = c
    h[j] = k
    pos[k] = j


@njit(cache=True)
def _push(h, pos, prio, k, n):
    h[n] = k
    pos[k] = n
    _sift_up(h, pos, prio, n)
    return n + 1


@njit(cache=True)
def _pop_unpinned(h, pos, prio, n, pin, g, buf):
    """Remove and return the lowest-priority key not pinned by group g; pinned ones go back in."""
    m = 0
    while True:
        if n == 0:
            raise RuntimeError("every resident expert is pinned")
        k = h[0]
        n -= 1
        pos[k] = -1
        if n > 0:
            h[0] = h[n]
            pos[h[0]] = 0
            _sift_down(h, pos, prio, 0, n)
        if pin[k] != g:
            break
        buf[m] = k
        m += 1
    for j in range(m):
        n = _push(h, pos, prio, buf[j], n)
    return k, n


@njit(cache=True)
def _heap_replay(keys, gstart, n_keys, capacity, next_use, belady):
    h, pos = np.zeros(n_keys, np.int64), np.full(n_keys, -1, np.int64)
    prio, pin, buf = np.zeros(n_keys, np.int64), np.full(n_keys, -1, np.int64), np.zeros(n_keys, np.int64)
    hits = np.zeros(len(keys), np.uint8)
    n, tick = 0, 0
    for g in range(len(gstart) - 1):
        for i in range(gstart[g], gstart[g + 1]):
            pin[keys[i]] = g
        for i in range(gstart[g], gstart[g + 1]):
            k = keys[i]
            tick += 1
            if pos[k] >= 0:
                hits[i] = 1
                if belady:  # farther next use = lower priority value = evicted first
                    prio[k] = -next_use[i]
                    _sift_up(h, pos, prio, pos[k])
                else:
                    prio[k] = (((prio[k] >> FREQ_SHIFT) + 1) << FREQ_SHIFT) | tick
                    _sift_down(h, pos, prio, pos[k], n)
                continue
            if n >= capacity:
                _, n = _pop_unpinned(h, pos, prio, n, pin, g, buf)
            prio[k] = -next_use[i] if belady else (1 << FREQ_SHIFT) | tick
            n = _push(h, pos, prio, k, n)
    return hits


def lfu_hits(keys: np.ndarray, gstart: np.ndarray, n_keys: int, capacity: int) -> np.ndarray:
    """LFUPolicy's decisions: lowest count since insertion, ties to the least recently used."""
    return _heap_replay(keys, gstart, n_keys, capacity, np.zeros(1, np.int64), False)


def belady_hits(keys: np.ndarray, gstart: np.ndarray, n_keys: int, capacity: int, next_use: np.ndarray) -> np.ndarray:
    """Belady's choice under access_layer's pinning: evict the unpinned key used again farthest in the future."""
    return _heap_replay(keys, gstart, n_keys, capacity, next_use, True)


@njit(cache=True)
def _next_use(keys, n_keys):
    out = np.empty(len(keys), np.int64)
    upcoming = np.full(n_keys, len(keys), np.int64)
    for i in range(len(keys) - 1, -1, -1):
        out[i] = upcoming[keys[i]]
        upcoming[keys[i]] = i
    return out


def next_use(keys: np.ndarray) -> np.ndarray:
    """Index of each access's next access to the same key, len(keys) when there is none (one backward pass)."""
    keys = np.ascontiguousarray(keys)
    return _next_use(keys, int(keys.max()) + 1 if len(keys) else 0)
