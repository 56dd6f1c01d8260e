"""The gateway's public HTTP handlers: the OpenAI routes and `/health` (`/metrics` has its own
listener: metrics_listener.py).

A completion goes through three steps, each in its own module: admit (gateway/admit.py: API key,
body checks, the model resolved (gateway/model_routes.py), the rate-limit reservation of one
request and its whole token count), route (gateway/dispatch.py: the route plan for the model,
then upstream with failover, and fallbacks) and relay (gateway/respond.py: the answer whole or
streamed, the reservation settled from the usage).
Every answer is counted and logged once (gateway/calls.py). aiohttp.web handlers: this is the hot
path (see docs/gateway.md for why not FastAPI here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from gateway.admit import admit, read_body
from gateway.cache_salt import cache_salt_of
from gateway.calls import Call, CallLog
from gateway.dispatch import Dispatch, upstream_headers
from gateway.edge import AutoTier
from gateway.errors import GatewayError, NotReadyError
from gateway.keys import ApiKey, KeyTable
from gateway.limit_shares import PopLimiter
from gateway.metrics import GatewayMetrics
from gateway.model_routes import ModelChoice
from gateway.openai_request import Endpoint, ParsedRequest, parse_request
from gateway.proxy import Proxy
from gateway.request_ids import HEADER
from gateway.respond import Respond
from gateway.routing import Router
from gateway.settings import GatewaySettings
from gateway.upstream_request import UpstreamRequest


@dataclass(slots=True)
class Handlers:
    settings: GatewaySettings
    keys: KeyTable
    router: Router
    metrics: GatewayMetrics
    auto: AutoTier | None = None  # the `auto` alias and the edge tier, when configured
    # The lifespan's, while it runs: without them the gateway answers 503.
    proxy: Proxy | None = None
    limiter: PopLimiter | None = None
    log: CallLog = field(init=False)
    dispatch: Dispatch = field(init=False)
    respond: Respond = field(init=False)

    def __post_init__(self) -> None:
        self.log = CallLog(self.metrics, self.settings.pop, self.settings.access_log)
        self.dispatch = Dispatch(self.settings, self.router, self.auto)
        self.respond = Respond(self.settings, self.router, self.metrics, self.log)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat", "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completions", "/v1/completions")

    async def _complete(
        self, request: web.Request, endpoint: Endpoint, path: str
    ) -> web.StreamResponse:
        call = Call.start(request)
        try:
            key = call.authenticate(self.keys)
            raw = await read_body(request, self.settings.max_body_bytes)
            salt = None if self.settings.share_prefix_cache else cache_salt_of(key.id)
            parsed = parse_request(raw, endpoint, self.settings.default_max_tokens, salt)
            proxy, limiter = self._proxy(), self._limiter()
            choice = self._model_choice(parsed, key)  # before admission: a 404 spends nothing
            admitted = await admit(limiter, self.metrics, key, parsed, choice)
            routed = await self.dispatch(proxy, limiter, call, admitted, path, choice)
        except GatewayError as exc:
            return self.log.refuse(call, exc)
        return await self.respond(proxy, limiter, call, admitted, routed)

    def _model_choice(self, parsed: ParsedRequest, key: ApiKey) -> ModelChoice:
        """The models `parsed` may be answered by (ModelNotFoundError, ModelNotAllowedError)."""
        name = parsed.model
        if self.auto is not None and self.auto.is_auto(parsed):
            name = self.auto.region_model  # what `auto` means at the regions
        return self.router.models.resolve(name, key)

    async def models(self, request: web.Request) -> web.StreamResponse:
        call = Call.start(request)
        try:
            key = call.authenticate(self.keys)
            upstream = UpstreamRequest(
                method="GET",
                path="/v1/models",
                body=None,
                headers=upstream_headers(self.settings, key, call.request_id, has_body=False),
                is_stream=False,
            )
            deadline_s = call.started_s + self.settings.request_deadline_s
            opened = await self._proxy().open(upstream, self.router.plan(0), deadline_s)
        except GatewayError as exc:
            return self.log.refuse(call, exc)
        opened.finish()
        region = opened.candidate.region
        headers = {
            HEADER: call.request_id,
            **self.log.where(region, "region"),
            **opened.passed_headers(),
        }
        self.log.record(call, opened.status, region, opened.num_retries)
        body = opened.body
        if self.auto is not None and opened.status == 200:
            body = self.auto.with_alias(body)
        return web.Response(body=body, status=opened.status, headers=headers)

    async def health(self, request: web.Request) -> web.StreamResponse:
        is_ready = self.keys.is_loaded and self.router.is_loaded
        body = {
            "status": "ok" if is_ready else "starting",
            "pop": self.settings.pop,
            "keys_loaded": self.keys.is_loaded,
            "num_keys": len(self.keys),
            "regions_loaded": self.router.is_loaded,
            "regions": {
                name: {
                    "state": state.summary.state,
                    "healthy_nodes": state.summary.healthy_nodes,
                    "rtt_ms": round(state.rtt_ms, 2),
                    "breaker": state.breaker.state.value,
                    "in_flight": state.num_in_flight,
                }
                for name, state in sorted(self.router.regions.items())
            },
            "edge": self.auto.edge_health() if self.auto is not None else None,
        }
        return web.json_response(body, status=200 if is_ready else 503)

    def _proxy(self) -> Proxy:
        if self.proxy is None:
            raise NotReadyError("the gateway is starting", "not_ready")
        if not self.router.is_loaded:
            raise NotReadyError("the gateway has not loaded region summaries yet", "not_ready")
        return self.proxy

    def _limiter(self) -> PopLimiter:
        if self.limiter is None:
            raise NotReadyError("the gateway is starting", "not_ready")
        return self.limiter
