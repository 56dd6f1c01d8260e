"""Prometheus metrics for one gateway (its own registry, so several can live in one process).

Counts carry an API key's id only when the operator asks (`metrics_key_labels`): a label per key
lists the tenants and their volume to whoever can scrape.

Label children are cached: `labels()` costs a lock and a dict lookup in prometheus_client, too
much to pay several times per request at thousands of requests a second.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

NO_REGION = "none"
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, pop: str, key_labels: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"pop": pop}
        self._key_labels = key_labels
        key_id = ["key_id"] if key_labels else []
        self._requests = Counter(
            "meridian_gateway_requests_total",
            "Requests answered, by serving region and HTTP status (and API key id when "
            "metrics_key_labels is on).",
            ["region", "status", *key_id],
            registry=self.registry,
        )
        self._decisions = Counter(
            "meridian_gateway_routing_decisions_total",
            "First-choice routing decisions, by region and how it was chosen.",
            ["region", "reason"],
            registry=self.registry,
        )
        self._retries = Counter(
            "meridian_gateway_retries_total",
            "Attempts that failed before the first byte and moved on, by region and cause.",
            ["region", "cause"],
            registry=self.registry,
        )
        self._ttft = Histogram(
            "meridian_gateway_upstream_ttft_seconds",
            "Time from sending a request upstream to its first token (streams) or its whole "
            "response (non-streams), by region and kind.",
            ["region", "kind"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._rate_limited = Counter(
            "meridian_gateway_rate_limited_total",
            "Requests refused by a per-key limit, by limit (and API key id when "
            "metrics_key_labels is on).",
            [*key_id, "limit"],
            registry=self.registry,
        )
        self._stream_errors = Counter(
            "meridian_gateway_stream_errors_total",
            "Streams ended with an error event after bytes were sent, by region.",
            ["region"],
            registry=self.registry,
        )
        self._resumes = Counter(
            "meridian_gateway_stream_resumes_total",
            "Streams that broke mid-way and continued in another region, by both regions.",
            ["from_region", "to_region"],
            registry=self.registry,
        )
        self._resumes_refused = Counter(
            "meridian_gateway_stream_resumes_refused_total",
            "Broken streams that could not continue elsewhere, by why not.",
            ["reason"],
            registry=self.registry,
        )
        self._resume_gap = Histogram(
            "meridian_gateway_stream_resume_gap_seconds",
            "Latency a resume added: from the last chunk of the broken attempt to the first of "
            "its continuation, as the client saw it, by the continuing region.",
            ["region"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._resume_latency = Histogram(
            "meridian_gateway_stream_resume_latency_seconds",
            "Where a resume's time goes, from the break being detected: to the continuation's "
            "first byte (phase reopen) and to its first chunk to the client (phase "
            "first_chunk), by the continuing region.",
            ["region", "phase"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._prewarms = Counter(
            "meridian_gateway_resume_prewarms_total",
            "Prompts sent ahead to the region a stream would resume in (resume_prewarm), by "
            "region and outcome (ok, an HTTP status, timeout or connect).",
            ["region", "outcome"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "meridian_gateway_in_flight_requests",
            "Requests being proxied now.",
            registry=self.registry,
        )
        info = Gauge(
            "meridian_gateway_info", "This gateway's PoP.", ["pop"], registry=self.registry
        )
        info.labels(**labels).set(1)
        self._counters: dict[tuple[int, tuple[str, ...]], Counter] = {}
        self._histograms: dict[tuple[int, tuple[str, ...]], Histogram] = {}

    def _counter(self, metric: Counter, *values: str) -> Counter:
        cache_key = (id(metric), values)
        child = self._counters.get(cache_key)
        if child is None:
            child = self._counters[cache_key] = metric.labels(*values)
        return child

    def _histogram(self, metric: Histogram, *values: str) -> Histogram:
        cache_key = (id(metric), values)
        child = self._histograms.get(cache_key)
        if child is None:
            child = self._histograms[cache_key] = metric.labels(*values)
        return child

    def _key_id(self, key_id: str) -> tuple[str, ...]:
        return (key_id,) if self._key_labels else ()

    def count_request(self, region: str, status: int, key_id: str) -> None:
        self._counter(self._requests, region, str(status), *self._key_id(key_id)).inc()

    def count_decision(self, region: str, reason: str) -> None:
        self._counter(self._decisions, region, reason).inc()

    def count_retry(self, region: str, cause: str) -> None:
        self._counter(self._retries, region, cause).inc()

    def observe_ttft(self, region: str, kind: str, seconds: float) -> None:
        self._histogram(self._ttft, region, kind).observe(seconds)

    def count_rate_limited(self, key_id: str, limit: str) -> None:
        self._counter(self._rate_limited, *self._key_id(key_id), limit).inc()

    def count_stream_error(self, region: str) -> None:
        self._counter(self._stream_errors, region).inc()

    def count_resume(self, from_region: str, to_region: str) -> None:
        self._counter(self._resumes, from_region, to_region).inc()

    def count_resume_refused(self, reason: str) -> None:
        self._counter(self._resumes_refused, reason).inc()

    def observe_resume_gap(self, region: str, seconds: float) -> None:
        self._histogram(self._resume_gap, region).observe(seconds)

    def observe_resume_latency(self, region: str, phase: str, seconds: float) -> None:
        self._histogram(self._resume_latency, region, phase).observe(seconds)

    def count_prewarm(self, region: str, outcome: str) -> None:
        self._counter(self._prewarms, region, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
