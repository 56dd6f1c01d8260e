"""Prometheus metrics named as vLLM names them, with the prefix `meridian:`.

Gauges and token counters are read from the engine's latest stats at scrape time; request
counters and latency histograms are updated per request. Every series has a `model_name` label.
`meridian:cache_config_info{block_size, num_gpu_blocks}` is the info-style gauge the Gateway API
Inference Extension reads block size and block count from (as `vllm:cache_config_info`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.llm_engine import EngineStats
from engine.outputs import RequestOutput

PREFIX = "meridian:"
TTFT_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS_S = (
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
REQUEST_BUCKETS_S = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)


class EngineStatsCollector(Collector):
    """Engine gauges and totals, read from the stats snapshot when Prometheus scrapes."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        model = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge(
            "num_waiting_prefill_tokens",
            "Prompt tokens of waiting requests still to prefill.",
            stats.num_waiting_prefill_tokens,
        )
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0 to 1).",
            stats.kv_cache_usage,
        )
        yield gauge("kv_cache_free_blocks", "KV-cache blocks free.", stats.kv_blocks_free)
        yield gauge(
            "decode_tokens_per_second",
            "Tokens generated per second, recent window.",
            stats.decode_tokens_per_s,
        )
        info = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "KV cache configuration (labels); the value is always 1.",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        info.add_metric([self._model_name, str(stats.block_size), str(stats.kv_blocks_total)], 1)
        yield info
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queried_tokens,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hit_tokens,
        )
        yield counter("prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter(
            "num_preemptions",
            "Requests preempted to free KV blocks.",
            stats.num_preemptions_total,
        )


class _WithoutCreated(Collector):
    """The registry without the `*_created` timestamps prometheus_client adds to counters and
    histograms (vLLM leaves them out too; text parsers read them as extra gauge families)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class NodeMetrics:
    """The node's own registry (one per app, so several apps can live in one process)."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused before the engine, by status.",
            ["model_name", "status"],
            registry=self.registry,
        )
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Arrival at the node to first token.", TTFT_BUCKETS_S
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS_S
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Arrival at the node to the last token.",
            REQUEST_BUCKETS_S,
        )
        self.queue_time = self._histogram(
            "request_queue_time_seconds",
            "Time in the engine's waiting queue before first being scheduled.",
            REQUEST_BUCKETS_S,
        )
        self.registry.register(EngineStatsCollector(model_name, stats))

    def _histogram(self, name: str, documentation: str, buckets_s: tuple[float, ...]) -> Histogram:
        """One of this model's latency histograms, in seconds."""
        family = Histogram(
            PREFIX + name, documentation, ["model_name"], buckets=buckets_s, registry=self.registry
        )
        return family.labels(model_name=self.model_name)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))

    def count_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def count_rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """One request's latencies, observed as its outputs arrive."""

    __slots__ = ("_finished", "_last_token_at", "_metrics", "started_at")

    def __init__(self, metrics: NodeMetrics):
        self._metrics = metrics
        self.started_at = time.monotonic()
        self._last_token_at: float | None = None
        self._finished = False

    @property
    def has_first_token(self) -> bool:
        return self._last_token_at is not None

    def on_output(self, output: RequestOutput) -> None:
        if not output.outputs[0].token_ids:
            return
        now = time.monotonic()
        if self._last_token_at is None:
            self._metrics.ttft.observe(now - self.started_at)
        else:
            self._metrics.itl.observe(now - self._last_token_at)
        self._last_token_at = now

    def finish(self, output: RequestOutput | None, finish_reason: str) -> float:
        """Record the end of the request (once); returns its end-to-end seconds."""
        elapsed_s = time.monotonic() - self.started_at
        if self._finished:
            return elapsed_s
        self._finished = True
        self._metrics.e2e.observe(elapsed_s)
        self._metrics.count_finished(finish_reason)
        if output is not None and output.metrics.first_scheduled_time is not None:
            queued_s = output.metrics.first_scheduled_time - output.metrics.arrival_time
            self._metrics.queue_time.observe(max(queued_s, 0.0))
        return elapsed_s
