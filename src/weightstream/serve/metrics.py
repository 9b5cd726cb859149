"""Prometheus metrics of a serving process (prometheus_client; one registry per server).

Counters the server updates as things happen (requests, tokens, step times, per-request latencies) are
prometheus_client metrics; values the engine already keeps (expert cache hits, bytes read, I/O wait, queue
depth, batch size, KV bytes) are read at scrape time by a collector, so there is one source for each number.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RATE_WINDOW_S = 10.0  # decode tokens/s is measured over the decode steps of the last 10 s


class ServeMetrics:
    """The scheduler's observer (prefilled, decoded, ended) and the HTTP layer's request counter."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.engine = None  # set once loaded: the ServeEngine whose live values the collector reads
        r = self.registry
        self.requests = Counter(
            "weightstream_requests", "HTTP API requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.sequences = Counter(
            "weightstream_sequences_ended",
            "Sequences that ended, by outcome (stop, length, cancelled, shutdown, failed)",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("weightstream_prompt_tokens", "Prompt tokens prefilled (tokens in)", registry=r)
        self.generated_tokens = Counter("weightstream_generation_tokens", "Tokens generated (tokens out)", registry=r)
        self.prefill_seconds = Counter("weightstream_prefill_seconds", "Time in prefill forwards", registry=r)
        self.decode_seconds = Counter("weightstream_decode_seconds", "Time in decode forwards", registry=r)
        self.batch_size = Histogram(
            "weightstream_decode_batch_size",
            "Sequences decoded together in each decode step",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "weightstream_time_to_first_token_seconds",
            "From arrival to first token, per request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "weightstream_time_per_output_token_seconds",
            "Mean gap between a request's tokens after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._window: deque[tuple[float, int, float]] = deque()  # (end time, tokens, seconds) of recent decode steps
        self._lock = threading.Lock()
        self.outcomes: Tally[str] = Tally()  # for the line the server prints when it stops
        r.register(_LiveCollector(self))

    def prefilled(self, tokens: int, seconds: float, generated: int = 1) -> None:
        """A prefill of `tokens` positions, which generated `generated` tokens (0: an echoed prompt only scored)."""
        self.prompt_tokens.inc(tokens)
        self.generated_tokens.inc(generated)
        self.prefill_seconds.inc(seconds)

    def decoded(self, batch: int, seconds: float) -> None:
        self.generated_tokens.inc(batch)
        self.decode_seconds.inc(seconds)
        self.batch_size.observe(batch)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, batch, seconds))
            while self._window and self._window[0][0] < now - RATE_WINDOW_S:
                self._window.popleft()

    def ended(self, seq, outcome: str) -> None:
        outcome = seq.finish_reason if outcome == "finished" else outcome
        self.sequences.labels(outcome).inc()
        self.outcomes[outcome] += 1
        times = seq.token_times
        if times:
            self.ttft.observe(times[0] - seq.arrived_s)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def decode_tokens_per_s(self) -> float:
        """Tokens per second of decode forwards over the last RATE_WINDOW_S (0 when idle)."""
        now = time.monotonic()
        with self._lock:
            recent = [(n, s) for t, n, s in self._window if t >= now - RATE_WINDOW_S]
        seconds = sum(s for _, s in recent)
        return sum(n for n, _ in recent) / seconds if seconds else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """Values owned by the engine and scheduler, read when Prometheus scrapes."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def collect(self):
        engine = self.metrics.engine
        ready = engine is not None and engine.ready
        yield _gauge("weightstream_ready", "1 once the model is loaded and the server takes requests", float(ready))
        if not ready:
            return
        sched, runtime = engine.scheduler, engine.model.weightstream
        stats = runtime.cache.stats
        lookups = stats.hits + stats.misses
        yield _gauge("weightstream_queue_depth", "Requests waiting to be admitted", sched.queued)
        yield _gauge("weightstream_running_batch_size", "Sequences decoding now", sched.running)
        yield _counter(
            "weightstream_preemptions",
            "Sequences sent back to wait (their KV dropped, prefilled again later) so the batch fits the KV budget",
            sched.preemptions,
        )
        yield _gauge("weightstream_kv_cache_bytes", "Bytes held by the running batch's KV cache", sched.kv_bytes)
        yield _gauge("weightstream_kv_cache_budget_bytes", "The KV budget (--kv-cache)", sched.kv_budget_bytes)
        yield _gauge(
            "weightstream_decode_tokens_per_second",
            f"Decode tokens/s over the last {RATE_WINDOW_S:.0f} s of decode steps",
            self.metrics.decode_tokens_per_s(),
        )
        yield _gauge(
            "weightstream_expert_hit_rate",
            "Expert lookups found in the cache, since start",
            stats.hits / lookups if lookups else 0.0,
        )
        yield _counter("weightstream_expert_hits", "Expert lookups found in the cache", stats.hits)
        yield _counter("weightstream_expert_misses", "Expert lookups that had to be read", stats.misses)
        yield _counter(
            "weightstream_device_read_bytes",
            "Bytes the expert cache read from the device (O_DIRECT spans)",
            runtime.cache.bytes_read,
        )
        yield _counter(
            "weightstream_io_wait_seconds",
            "Time compute waited for expert reads",
            runtime.counters.io_wait_s + stats.eviction_wait_s,
        )
        yield _gauge(
            "weightstream_miss_copy_bits",
            "--miss-copy: bits of the small copies a miss reads and computes with (tokens are then not the model's "
            "exact ones); 0: exact mode",
            runtime.miss_copy_bits,
        )
        yield _counter(
            "weightstream_miss_copy_reads",
            "--miss-copy: misses that read an expert's small copy",
            stats.miss_copy_reads,
        )
        yield _counter(
            "weightstream_miss_copy_read_bytes", "--miss-copy: bytes read for small copies", stats.miss_copy_bytes
        )
        yield _counter(
            "weightstream_expert_upgrades",
            "--miss-copy: hits on a small copy, read in full precision into its slot before computing",
            stats.upgrades,
        )
        yield _counter(
            "weightstream_expert_upgrade_read_bytes", "--miss-copy: bytes read for upgrades", stats.upgrade_bytes
        )
        yield _counter(
            "weightstream_miss_copy_hits",
            "--miss-copy: hits computed with a small copy, nothing read (before --upgrade-after's hit)",
            stats.miss_copy_hits,
        )
        yield _gauge(
            "weightstream_expert_cache_bytes",
            "Memory of the expert cache (its byte budget)",
            runtime.cache.memory_bytes,
        )
        if runtime.shards is not None:
            yield from _shard_metrics(runtime.shards)
        totals = engine.recorder.snapshot()
        yield _counter("weightstream_decode_steps", "Decode forwards", totals.steps)
        yield _counter(
            "weightstream_decode_expert_choices", "Per decode step and MoE layer: batch x top-k, summed", totals.choices
        )
        yield _counter(
            "weightstream_decode_distinct_experts",
            "Per decode step and MoE layer: distinct experts chosen (the batch's union), summed",
            totals.distinct,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


SHARD_METRICS = (  # (name, kind, what, LinkStats field) of each expert shard, labelled shard="i" (--expert-shards)
    (
        "weightstream_shard_up",
        "gauge",
        "1 while the head sends the shard its rows; 0 while it computes them itself",
        "up",
    ),
    ("weightstream_shard_experts", "gauge", "Experts the shard holds in memory", None),
    ("weightstream_shard_round_trips", "counter", "Layer round trips to the shard", "round_trips"),
    ("weightstream_shard_round_trip_seconds", "counter", "Time in round trips to the shard", "round_trip_s"),
    ("weightstream_shard_rows", "counter", "(token, k) rows the shard computed", "rows"),
    ("weightstream_shard_sent_bytes", "counter", "Hidden rows, top-k index and weights sent", "bytes_out"),
    ("weightstream_shard_received_bytes", "counter", "Contribution rows received from the shard", "bytes_in"),
    (
        "weightstream_shard_failures",
        "counter",
        "Calls that failed or timed out (the shard then taken as down)",
        "failures",
    ),
    (
        "weightstream_shard_fallback_rows",
        "counter",
        "The shard's rows the head computed while it was down",
        "fallback_rows",
    ),
    ("weightstream_shard_readmitted", "counter", "Times the shard came back after failing", "readmitted"),
)


def _shard_metrics(sharded):
    """Per expert shard, from what the head measured (no call to the shards at scrape time)."""
    for name, kind, doc, attr in SHARD_METRICS:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["shard"])
        for i, stats in enumerate(sharded.stats):
            value = sum(map(len, sharded.owned[i].values())) if attr is None else float(getattr(stats, attr))
            family.add_metric([str(i)], value)
        yield family
