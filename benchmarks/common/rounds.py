"""Back to back against a peer: each side once a round, the order reversed every other round, since these machines
drift by 15-25% over minutes. What gguf_speed, serve_vs_llamacpp and prefill_limit share."""

from __future__ import annotations

from collections.abc import Callable


def alternated(rounds: int, sides: dict[str, Callable[[], dict]], said: Callable[[int, str, dict], None]) -> dict:
    """Run each of `sides` (name -> one run) once a round, in the given order in even rounds and reversed in odd
    ones; said(round, name, result) after each run. Each side's results in round order."""
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            got = sides[name]()
            runs[name].append(got)
            said(r + 1, name, got)
    return runs
