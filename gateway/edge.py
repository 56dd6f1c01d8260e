"""The edge tier at this PoP: requests for the model alias `auto` that `tiers.classify` finds
light go to the edge node agent beside the gateway; the rest, and everything while the edge is
saturated (`edge_max_concurrency` requests in flight from here) or down (its circuit open after
failures), go to a region as any request does. An edge attempt that fails before the first byte
falls back to the regions within the same request, so nothing is lost to a dead edge.

The edge serves one model, `edge_model` (default `auto_model`). `auto` means `auto_model`,
resolved through the document's catalog as any name (gateway/model_routes.py): it goes to the
edge only while it resolves to the edge's model (`edge_model` resolved the same way), so an
alias flip that moves `auto` to another model moves all of it to the regions, and no other
model's request ever reaches the edge. Under a version 1 document (model-blind) the edge gets
`auto` as `edge_model` and the regions as `auto_model`, as before models. The body sent upstream
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
from gateway.region_state import RegionState
from gateway.routing import Candidate, RoutePlan, Router
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

    def __init__(
        self, settings: GatewaySettings, registry: CollectorRegistry, router: Router
    ) -> None:
        assert settings.auto_model is not None
        self._settings = settings
        self._router = router  # its document's catalog resolves the edge's model
        self.region_model = settings.auto_model
        self.edge_model = settings.edge_model or settings.auto_model
        self.thresholds = EdgeThresholds(settings.edge_max_prompt_tokens, settings.edge_max_tokens)
        self.edge = _edge_state(settings)
        self.metrics = TierMetrics(registry, settings)

    @staticmethod
    def is_auto(parsed: ParsedRequest) -> bool:
        return parsed.model == AUTO_MODEL

    def edge_model_now(self) -> str:
        """The model the edge serves, resolved through the document held now."""
        return self._router.models.model_of.get(self.edge_model, self.edge_model)

    def choose(
        self, parsed: ParsedRequest, key: ApiKey, model: str | None, now_s: float
    ) -> TierChoice:
        """`model`: what the request resolved to (None: a version 1 document)."""
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
            is_edge_model=model is None or model == self.edge_model_now(),
        )

    async def open(
        self,
        proxy: Proxy,
        request: UpstreamRequest,
        parsed: ParsedRequest,
        key: ApiKey,
        plan: RoutePlan,
        deadline_s: float,
        model: str | None,
    ) -> tuple[Opened, Tier]:
        """The edge's answer if the request is light, resolved to the edge's model and the edge
        answers, else a region's. `model`: what `auto` resolved to, which `request` names
        already (None: a version 1 document; `request` names `auto`)."""
        choice = self.choose(parsed, key, model, time.monotonic())
        if choice.tier == "edge" and self.edge is not None:
            to_edge = request if model is not None else _with_model(request, self.edge_model)
            opened = await self._open_edge(proxy, to_edge, deadline_s)
            if opened is not None:
                self.metrics.count("edge", choice.reason)
                return opened, "edge"
            choice = TierChoice("region", "down")
        to_region = request if model is not None else _with_model(request, self.region_model)
        opened = await proxy.open(to_region, plan, deadline_s)
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
        candidate = Candidate(edge.summary.name, url, 0.0, 0.0, 0.0, 0)  # beside the PoP
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
            "model": self.edge_model_now(),
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
