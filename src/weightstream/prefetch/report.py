"""What a prefetch run did, for operators: printed on stderr at exit and optionally written as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from weightstream.units import format_bytes


@dataclass(slots=True)
class RunReport:
    """The observability record of one `prefetch run`."""

    spec: dict[str, str]
    template_used: bool
    template_reason: str
    source: str | None  # "tracefs" or "residency": where loader events came from
    exit_code: int
    load_seconds: float
    bytes_template: int = 0
    bytes_prefetched: int = 0
    bytes_already_cached: int = 0
    bytes_used: int | None = None  # None: not observable without tracefs access events
    bytes_abandoned: int = 0
    bytes_reclaimed: int = 0
    bytes_reread_after_reclaim: int = 0
    bytes_loader_missed: int = 0
    peak_ahead: int = 0
    rewinds: int = 0
    bytes_evicted_before_use: int = 0
    final_budget: int | None = None
    memory_budget: int | None = None
    reclaim_gap: int | None = None
    threads: int = 0
    numa: str = ""
    pressure_pauses: int = 0
    failed_chunks: int = 0
    events: int = 0
    events_lost: int = 0
    timeline: list = field(default_factory=list)  # (s, worker, loader position, prefetch position, ahead)

    @property
    def bytes_unused(self) -> int | None:
        """Prefetched but never seen read by the loader."""
        return None if self.bytes_used is None else max(0, self.bytes_prefetched - self.bytes_used)

    def lines(self) -> list[str]:
        """Human-readable lines for stderr."""
        head = f"load {self.load_seconds:.2f} s, exit {self.exit_code}"
        if not self.template_used:
            return [f"{head}; no prefetch (template not used, reason above)"]
        used = "n/a (no access events without tracefs)" if self.bytes_used is None else format_bytes(self.bytes_used)
        lines = [
            f"{head}; template used ({self.source} events, {self.threads} threads)",
            f"prefetched {format_bytes(self.bytes_prefetched)} of {format_bytes(self.bytes_template)} "
            f"(already cached {format_bytes(self.bytes_already_cached)}), used by the loader {used}, "
            f"abandoned {format_bytes(self.bytes_abandoned)}",
            f"reclaimed {format_bytes(self.bytes_reclaimed)}, re-read after reclaim "
            f"{format_bytes(self.bytes_reread_after_reclaim)}, "
            f"loader read itself {format_bytes(self.bytes_loader_missed)}",
        ]
        if self.memory_budget is not None:
            gap = "no reclaim" if self.reclaim_gap is None else f"reclaim gap {format_bytes(self.reclaim_gap)}"
            lines.append(
                f"budget {format_bytes(self.memory_budget)}: at most {format_bytes(self.peak_ahead)} was ahead of the "
                f"loader; {gap}"
            )
        if self.bytes_evicted_before_use:
            lines.append(
                f"memory pressure: {format_bytes(self.bytes_evicted_before_use)} prefetched was evicted before "
                f"use; budget cut to {format_bytes(self.final_budget or 0)}"
            )
        if self.rewinds:
            lines.append(
                f"the loader went back {self.rewinds}x (another pass over evicted data): prefetch followed, "
                "burn-after-reading stopped"
            )
        if self.pressure_pauses or self.failed_chunks or self.events_lost:
            lines.append(
                f"paused {self.pressure_pauses}x for memory pressure, {self.failed_chunks} chunks failed, "
                f"{self.events_lost} trace events lost"
            )
        return lines

    def to_json(self) -> str:
        """The full record as JSON (bytes_unused included)."""
        doc = asdict(self)
        doc["bytes_unused"] = self.bytes_unused
        return json.dumps(doc, indent=1)

    def write(self, path: str | Path) -> None:
        """Write the JSON report."""
        Path(path).write_text(self.to_json() + "\n")
