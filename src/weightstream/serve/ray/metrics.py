"""A replica's Prometheus metrics (serve/metrics.py) mirrored into Ray's metrics export, so each replica's
figures reach Prometheus the way Ray exports any metric: from every node's metrics agent, named ray_<name>, tagged
with the replica, deployment and application (ray.serve.metrics adds those).

Every MIRROR_PERIOD_S the registry is collected once (the same values /metrics renders): counters become Ray counters
(incremented by what they grew), gauges Ray gauges, and a histogram's cumulative samples (_bucket with `le`, _count,
_sum) Ray gauges of the same names, since Ray's histograms take observations, not cumulative buckets.
"""

from __future__ import annotations

import threading

from ray.serve import metrics as ray_metrics

MIRROR_PERIOD_S = 1.0


class RayMetricsMirror:
    """Copies `registry` into Ray metrics every `period_s` in a thread of its own, until `stop()`."""

    def __init__(self, registry, period_s: float = MIRROR_PERIOD_S):
        self.registry, self.period_s = registry, period_s
        self._metrics: dict[str, object] = {}
        self._last: dict[tuple, float] = {}  # (counter, label values) -> value at the last copy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ws-ray-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.copy()

    def copy(self) -> None:
        """One copy of every sample."""
        for family in self.registry.collect():
            for sample in family.samples:
                if family.type == "counter" and sample.name.endswith("_total"):
                    self._counter(sample.name.removesuffix("_total"), family.documentation, sample)
                elif family.type in ("counter", "gauge", "histogram"):  # _created samples are turned off
                    self._gauge(sample.name, family.documentation, sample)

    def _counter(self, name: str, doc: str, sample) -> None:
        counter = self._metric(ray_metrics.Counter, name, doc, sample.labels)
        key = (name, tuple(sorted(sample.labels.items())))
        grown = sample.value - self._last.get(key, 0.0)
        if grown > 0:
            counter.inc(grown, tags=sample.labels or None)
        self._last[key] = sample.value

    def _gauge(self, name: str, doc: str, sample) -> None:
        self._metric(ray_metrics.Gauge, name, doc, sample.labels).set(sample.value, tags=sample.labels or None)

    def _metric(self, kind, name: str, doc: str, labels: dict):
        metric = self._metrics.get(name)
        if metric is None:
            metric = self._metrics[name] = kind(name, description=doc, tag_keys=tuple(sorted(labels)))
        return metric
