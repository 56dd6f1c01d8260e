"""The edge tier at this PoP: requests for the model alias `auto` that `tiers.classify` finds
light go to the edge node agent beside the gateway; the rest, and everything while the edge is
saturated (`edge_max_concurrency` requests in flight from here) or down (its circuit open after
failures), go to a region as any request does. An edge attempt that fails before the first byte
falls back to the regions within the same request, so nothing is lost to a dead edge.

`auto` means `auto_model` at the regions and `edge_model` at the edge; the body sent upstream
names the real model. Metrics: the thresholds, and `auto` requests by tier and reason with the
share each tier served.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.breaker import CircuitBreaker
from gateway.errors import GatewayError
from gateway.keys import ApiKey
from gateway.openai_request import ParsedRequest
from gateway.proxy import Opened, Proxy
from gateway.routing import Candidate, RegionState, RoutePlan
from gateway.settings import GatewaySettings
from gateway.tiers import (
    AUTO_MODEL,
    EdgePolicy,
    EdgeThresholds,
    Tier,
    TierChoice,
    classify,
)
from gateway.upstream_request import UpstreamRequest
from wire.geo import locate
from wire.region_summary import QueueEstimate, RegionSummary

TIERS: tuple[Tier, ...] = ("edge", "region")


class TierMetrics:
    def __init__(self, registry: CollectorRegistry, settings: GatewaySettings) -> None:
        self._requests = Counter(
            "meridian_gateway_auto_requests_total",
            "Requests for the model alias `auto`, by the tier that answered and why.",
            ["tier", "reason"],
            registry=registry,
        )
        self._share = Gauge(
            "meridian_gateway_auto_tier_share",
            "Share of this gateway's `auto` requests served by each tier.",
            ["tier"],
            registry=registry,
        )
        thresholds = Gauge(
            "meridian_gateway_edge_threshold",
            "The edge classifier's settings: max_prompt_tokens, max_tokens, max_concurrency.",
            ["setting"],
            registry=registry,
        )
        thresholds.labels("max_prompt_tokens").set(settings.edge_max_prompt_tokens)
        thresholds.labels("max_tokens").set(settings.edge_max_tokens)
        thresholds.labels("max_concurrency").set(settings.edge_max_concurrency)
        self._counts = dict.fromkeys(TIERS, 0)

    def count(self, tier: Tier, reason: str) -> None:
        self._requests.labels(tier, reason).inc()
        self._counts[tier] += 1
        total = sum(self._counts.values())
        for name, num in self._counts.items():
            self._share.labels(name).set(num / total)


def _with_model(request: UpstreamRequest, model: str) -> UpstreamRequest:
    assert request.body is not None
    return replace(request, body=request.body.edited({"model": model}))


def _edge_state(settings: GatewaySettings) -> RegionState | None:
    """The edge as a one-node site: in-flight count and circuit breaker, as for a region."""
    if settings.edge_url is None:
        return None
    place = locate(settings.pop)
    summary = RegionSummary(
        name=f"edge-{settings.pop}",
        lat=place.lat,
        lon=place.lon,
        state="active",
        ingress_url=settings.edge_url,
        healthy_nodes=1,
        kv_blocks_free=0,
        kv_blocks_total=0,
        queue=QueueEstimate(
            num_waiting=0,
            num_waiting_prefill_tokens=0,
            decode_tokens_per_s=0.0,
            expected_queue_delay_s=0.0,
        ),
        weight=1.0,
    )
    breaker = CircuitBreaker(
        f"edge {settings.pop}", settings.breaker_failures, settings.breaker_open_s
    )
    return RegionState(summary, 0.0, breaker)


class AutoTier:
    """`auto` requests at this gateway (only built when `auto_model` is set)."""

    def __init__(self, settings: GatewaySettings, registry: CollectorRegistry) -> None:
        assert settings.auto_model is not None
        self._settings = settings
        self.region_model = settings.auto_model
        self.edge_model = settings.edge_model or settings.auto_model
        self.thresholds = EdgeThresholds(settings.edge_max_prompt_tokens, settings.edge_max_tokens)
        self.edge = _edge_state(settings)
        self.metrics = TierMetrics(registry, settings)

    @staticmethod
    def is_auto(parsed: ParsedRequest) -> bool:
        return parsed.model == AUTO_MODEL

    def choose(self, parsed: ParsedRequest, key: ApiKey, now_s: float) -> TierChoice:
        policy: EdgePolicy = self._settings.edge_policy.get(key.id, "auto")
        edge = self.edge
        return classify(
            parsed.prompt_tokens,
            parsed.max_tokens,
            self.thresholds,
            policy,
            is_edge_up=edge is not None and edge.breaker.is_available(now_s),
            is_edge_saturated=edge is not None
            and edge.num_in_flight >= self._settings.edge_max_concurrency,
            has_edge=edge is not None,
        )

    async def open(
        self,
        proxy: Proxy,
        request: UpstreamRequest,
        parsed: ParsedRequest,
        key: ApiKey,
        plan: RoutePlan,
        deadline_s: float,
    ) -> tuple[Opened, Tier]:
        """The edge's answer if the request is light and the edge answers, else a region's."""
        choice = self.choose(parsed, key, time.monotonic())
        if choice.tier == "edge" and self.edge is not None:
            opened = await self._open_edge(proxy, _with_model(request, self.edge_model), deadline_s)
            if opened is not None:
                self.metrics.count("edge", choice.reason)
                return opened, "edge"
            choice = TierChoice("region", "down")
        opened = await proxy.open(_with_model(request, self.region_model), plan, deadline_s)
        self.metrics.count("region", choice.reason)
        return opened, "region"

    async def _open_edge(
        self, proxy: Proxy, request: UpstreamRequest, deadline_s: float
    ) -> Opened | None:
        edge = self.edge
        assert edge is not None and edge.summary.ingress_url is not None
        now_s = time.monotonic()
        edge.breaker.on_attempt(now_s)
        url = edge.summary.ingress_url.rstrip("/")
        candidate = Candidate(edge.summary.name, url, 0.0, 0.0)
        edge.num_in_flight += 1
        try:
            opened = await proxy.open(request, RoutePlan([candidate], "only"), deadline_s)
        except GatewayError:
            opened = None
        except BaseException:
            edge.num_in_flight -= 1
            edge.breaker.on_abandon()
            raise
        if opened is None or opened.status >= 500 or opened.status == 429:
            edge.num_in_flight -= 1
            edge.breaker.on_failure(time.monotonic())
            return None
        edge.breaker.on_success()
        opened.state = edge  # its `finish()` ends the edge's in-flight count
        return opened

    def edge_health(self) -> dict[str, object] | None:
        """The edge as `/health` shows it (None: this PoP has none)."""
        edge = self.edge
        if edge is None:
            return None
        return {
            "url": edge.summary.ingress_url,
            "breaker": edge.breaker.state.value,
            "in_flight": edge.num_in_flight,
            "max_concurrency": self._settings.edge_max_concurrency,
        }

    def with_alias(self, models_body: bytes) -> bytes:
        """A `/v1/models` list with `auto` added."""
        try:
            listing = json.loads(models_body)
            data = listing["data"]
        except (ValueError, KeyError, TypeError):
            return models_body
        if isinstance(data, list) and not any(m.get("id") == AUTO_MODEL for m in data):
            data.append({"id": AUTO_MODEL, "object": "model", "owned_by": "meridian"})
        return json.dumps(listing).encode()
