"""Compiled replay kernels: the same decisions as access_layer + the policy classes, over dense key ids.

Inputs everywhere: ``keys`` (int32 [A], dense key per access, layer position * experts + expert) and
``gstart`` (int64 [G+1], access offset of each layer group = one access_layer call). A group's keys are pinned
while it is served, exactly as access_layer pins them. Each kernel returns a per-access hit mask (uint8 [A]).
Without numba the same code runs as plain Python (correct, slow).
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba is a declared dependency; keep the simulator usable without it

    def njit(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda f: f)


COLD = np.iinfo(np.int32).max  # stack distance of a key never seen before


@njit(cache=True)
def _fenwick_add(tree, i, delta):
    while i < len(tree):
        tree[i] += delta
        i += i & -i


@njit(cache=True)
def _fenwick_prefix(tree, i):
    s = 0
    while i > 0:
        s += tree[i]
        i -= i & -i
    return s


@njit(cache=True)
def lru_distances(keys, gstart, n_keys):
    """Per access: distinct other keys used between its previous use and its group's start (-1: repeat in group).

    Under access_layer's pinning, LRU with C slots hits exactly the accesses with distance < C (C >= any group).
    """
    tree = np.zeros(len(keys) + 1, np.int32)  # 1 at the latest access position of every key
    last = np.full(n_keys, -1, np.int64)
    group_of = np.full(n_keys, -1, np.int64)
    dist = np.empty(len(keys), np.int32)
    for g in range(len(gstart) - 1):
        a, b = gstart[g], gstart[g + 1]
        for i in range(a, b):  # queries see the state at the group's start
            k = keys[i]
            if group_of[k] == g:
                dist[i] = -1
            elif last[k] < 0:
                dist[i] = COLD
            else:
                dist[i] = _fenwick_prefix(tree, a) - _fenwick_prefix(tree, last[k] + 1)
            group_of[k] = g
        for i in range(a, b):
            k = keys[i]
            if last[k] >= 0:
                _fenwick_add(tree, last[k] + 1, -1)
            _fenwick_add(tree, i + 1, 1)
            last[k] = i
    return dist


# Doubly linked lists over key ids, oldest at the head (the order OrderedDict iterates in).
@njit(cache=True)
def _unlink(k, prv, nxt, ends, lst):
    p, n = prv[k], nxt[k]
    if p >= 0:
        nxt[p] = n
    else:
        ends[lst, 0] = n
    if n >= 0:
        prv[n] = p
    else:
        ends[lst, 1] = p


@njit(cache=True)
def _append(k, prv, nxt, ends, lst):
    tail = ends[lst, 1]
    prv[k], nxt[k] = tail, -1
    if tail >= 0:
        nxt[tail] = k
    else:
        ends[lst, 0] = k
    ends[lst, 1] = k


@njit(cache=True)
def _first_unpinned(lst, nxt, ends, pin, g):
    k = ends[lst, 0]
    while k >= 0 and pin[k] == g:
        k = nxt[k]
    return k


@njit(cache=True)
def _slru_promote(k, seg, prv, nxt, ends, n_protected, protected_capacity):
    """A hit moves k to protected's newest end; overflow demotes protected's oldest to probation's newest."""
    _unlink(k, prv, nxt, ends, seg[k])
    if seg[k] == 1:
        n_protected += 1
    seg[k] = 2
    _append(k, prv, nxt, ends, 2)
    if n_protected > protected_capacity:
        d = ends[2, 0]
        _unlink(d, prv, nxt, ends, 2)
        _append(d, prv, nxt, ends, 1)
        seg[d], n_protected = 1, n_protected - 1
    return n_protected


@njit(cache=True)
def slru_hits(keys, gstart, n_keys, capacity, protected_capacity):
    """SLRUPolicy's decisions (list 1 = probation, list 2 = protected, 0 = absent)."""
    prv, nxt = np.full(n_keys, -1, np.int64), np.full(n_keys, -1, np.int64)
    ends = np.full((3, 2), -1, np.int64)
    seg, pin = np.zeros(n_keys, np.int8), np.full(n_keys, -1, np.int64)
    hits = np.zeros(len(keys), np.uint8)
    size, n_protected = 0, 0
    for g in range(len(gstart) - 1):
        for i in range(gstart[g], gstart[g + 1]):
            pin[keys[i]] = g
        for i in range(gstart[g], gstart[g + 1]):
            k = keys[i]
            if seg[k] > 0:
                hits[i] = 1
                n_protected = _slru_promote(k, seg, prv, nxt, ends, n_protected, protected_capacity)
                continue
            if size >= capacity:
                v = _first_unpinned(1, nxt, ends, pin, g)
                if v < 0:
                    v = _first_unpinned(2, nxt, ends, pin, g)
                    if v < 0:
                        raise RuntimeError("every resident expert is pinned")
                    n_protected -= 1
                _unlink(v, prv, nxt, ends, seg[v])
                seg[v], size = 0, size - 1
            seg[k], size = 1, size + 1
            _append(k, prv, nxt, ends, 1)
    return hits


@njit(cache=True)
def pinned_hits(keys, gstart, n_keys, capacity, static):
    """PinnedPolicy's decisions: `static` keys stay once loaded, the rest share LRU scratch slots (list 0)."""
    prv, nxt = np.full(n_keys, -1, np.int64), np.full(n_keys, -1, np.int64)
    ends = np.full((1, 2), -1, np.int64)
    resident, pin = np.zeros(n_keys, np.uint8), np.full(n_keys, -1, np.int64)
    hits = np.zeros(len(keys), np.uint8)
    size = 0
    for g in range(len(gstart) - 1):
        for i in range(gstart[g], gstart[g + 1]):
            pin[keys[i]] = g
        for i in range(gstart[g], gstart[g + 1]):
            k = keys[i]
            if resident[k]:
                hits[i] = 1
                if not static[k]:
                    _unlink(k, prv, nxt, ends, 0)
                    _append(k, prv, nxt, ends, 0)
                continue
            if size >= capacity:
                v = _first_unpinned(0, nxt, ends, pin, g)
                if v < 0:
                    raise RuntimeError("every resident expert is pinned")
                _unlink(v, prv, nxt, ends, 0)
                resident[v], size = 0, size - 1
            resident[k], size = 1, size + 1
            if not static[k]:
                _append(k, prv, nxt, ends, 0)
    return hits


@njit(cache=True)
def largest_group(keys, gstart, n_keys):
    """Most distinct keys any one group (layer of a step) uses."""
    group_of = np.full(n_keys, -1, np.int64)
    best = 0
    for g in range(len(gstart) - 1):
        n = 0
        for i in range(gstart[g], gstart[g + 1]):
            if group_of[keys[i]] != g:
                group_of[keys[i]] = g
                n += 1
        best = max(best, n)
    return best


@njit(cache=True)
def wave_order(keys, gstart, n_keys, capacity):
    """Every group cut into waves of at most `capacity` distinct keys: (order, calls), the trace index of every access
    in lookup order and the offsets (into that order) of each wave, each one access_layer call.

    Same rule as cache.policy.wave_positions, which the runtime applies to a batched step's layer: a group's keys join
    waves in the order they first appear, `capacity` to a wave, and a wave holds all its keys' accesses in trace
    order (so within a wave the order is the trace's, and a group that fits is one wave in trace order).
    """
    order = np.empty(len(keys), np.int64)
    out = np.empty(len(keys) + 1, np.int64)
    seen = np.full(n_keys, -1, np.int64)  # the group that last ranked the key
    rank = np.zeros(n_keys, np.int64)  # its first appearance among the group's distinct keys
    n_out = 0
    for g in range(len(gstart) - 1):
        a, b = gstart[g], gstart[g + 1]
        if a == b:
            continue
        distinct = 0
        for i in range(a, b):
            k = keys[i]
            if seen[k] != g:
                seen[k], rank[k] = g, distinct
                distinct += 1
        n_waves = (distinct + capacity - 1) // capacity
        fill = np.zeros(n_waves + 1, np.int64)  # accesses before each wave, then its next free place
        for i in range(a, b):
            fill[rank[keys[i]] // capacity + 1] += 1
        for w in range(n_waves):
            fill[w + 1] += fill[w]
            out[n_out + w] = a + fill[w]
        n_out += n_waves
        for i in range(a, b):
            w = rank[keys[i]] // capacity
            order[a + fill[w]] = i
            fill[w] += 1
    out[n_out] = len(keys)
    return order, out[: n_out + 1].copy()
