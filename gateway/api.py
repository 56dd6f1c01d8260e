"""The gateway's public HTTP handlers: the OpenAI routes and `/health` (`/metrics` has its own
listener: metrics_listener.py).

A completion request goes: request id → API key → body checks → rate-limit admission (one
request and the whole token reservation) → route plan → upstream with failover → the answer,
whole or streamed → settle the reservation from the usage → metrics and one access-log line.
aiohttp.web handlers: this is the hot path (see docs/gateway.md for why not FastAPI here).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial

from aiohttp import web

from gateway.cache_salt import cache_salt_of
from gateway.edge import AutoTier
from gateway.errors import (
    BodyTooLargeError,
    GatewayError,
    NotReadyError,
    RateLimitError,
    UpstreamError,
    error_response,
)
from gateway.keys import ApiKey, KeyTable
from gateway.limit_shares import PopLimiter
from gateway.limits import Admission
from gateway.metrics import NO_REGION, GatewayMetrics
from gateway.openai_request import Endpoint, ParsedRequest, parse_request
from gateway.prewarm import prewarm
from gateway.proxy import Opened, Proxy
from gateway.relay import SilenceLimits, StreamRelay
from gateway.request_ids import HEADER, current_request_id, request_id_from
from gateway.resume import Resumer
from gateway.routing import Router
from gateway.settings import GatewaySettings
from gateway.sse import StreamReader, usage_of
from gateway.tiers import Tier
from gateway.upstream_request import UpstreamRequest
from gateway.whole import BodySink, whole_body
from wire.cache_salt import CACHE_SALT_HEADER

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("gateway.access")

REGION_HEADER = "x-meridian-region"
POP_HEADER = "x-meridian-pop"
TIER_HEADER = "x-meridian-tier"  # edge or region
NO_KEY = "-"


def _rate_limit_error(admission: Admission, num_tokens: int) -> RateLimitError:
    if admission.is_too_large:
        message = (
            f"Request too large for tokens per min (TPM): Limit {admission.tpm}, Requested "
            f"{num_tokens} (max_tokens, and the prompt counted as at most one token per UTF-8 "
            "byte). Lower max_tokens or the prompt."
        )
    elif admission.limited_by == "requests":
        message = (
            f"Rate limit reached for requests per min (RPM): Limit {admission.rpm}. Please try "
            f"again in {admission.retry_after_s:.1f}s."
        )
    else:
        message = (
            f"Rate limit reached for tokens per min (TPM): Limit {admission.tpm}, Requested "
            f"{num_tokens}. Please try again in {admission.retry_after_s:.1f}s."
        )
    return RateLimitError(message, "rate_limit_exceeded", headers=admission.headers())


@dataclass(slots=True)
class Handlers:
    settings: GatewaySettings
    keys: KeyTable
    router: Router
    metrics: GatewayMetrics
    proxy: Proxy | None = None  # set by the lifespan
    limiter: PopLimiter | None = None
    auto: AutoTier | None = None  # the `auto` alias and the edge tier, when configured
    silence: SilenceLimits = field(init=False)  # every stream's, from the settings and router
    _prewarms: set[asyncio.Task[None]] = field(default_factory=set, init=False)  # while running

    def __post_init__(self) -> None:
        self.silence = SilenceLimits(
            self.settings.stream_idle_timeout_s,
            self.settings.unhealthy_node_silence_s,
            self.router.summary_of,
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat", "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completions", "/v1/completions")

    async def models(self, request: web.Request) -> web.StreamResponse:
        started_s = time.monotonic()
        request_id = request_id_from(request.headers.get(HEADER))
        current_request_id.set(request_id)
        key: ApiKey | None = None
        try:
            key = self.keys.authenticate(request.headers.get("authorization"))
            proxy = self._proxy()
            plan = self.router.plan(0)
            deadline_s = started_s + self.settings.request_deadline_s
            upstream = UpstreamRequest(
                method="GET",
                path="/v1/models",
                body=None,
                headers=self._upstream_headers(key, request_id, has_body=False),
                is_stream=False,
            )
            opened = await proxy.open(upstream, plan, deadline_s)
        except GatewayError as exc:
            return self._refuse(request, exc, key, request_id, started_s)
        opened.finish()
        region = opened.candidate.region
        headers = {
            HEADER: request_id,
            **self._where(region, "region"),
            **opened.passed_headers(),
        }
        self._count_and_log(request, opened.status, region, key, started_s, opened.num_retries)
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

    # The completion flow.

    async def _complete(
        self, request: web.Request, endpoint: Endpoint, path: str
    ) -> web.StreamResponse:
        started_s = time.monotonic()
        request_id = request_id_from(request.headers.get(HEADER))
        current_request_id.set(request_id)
        key: ApiKey | None = None
        try:
            key = self.keys.authenticate(request.headers.get("authorization"))
            raw = await self._read_body(request)
            parsed = parse_request(raw, endpoint, self.settings.default_max_tokens)
            proxy, limiter = self._proxy(), self._limiter()
            admission = await limiter.admit(key, parsed.reserved_tokens)
            if not admission.is_allowed:
                self.metrics.count_rate_limited(key.id, admission.limited_by or "tokens")
                raise _rate_limit_error(admission, parsed.reserved_tokens)
            try:
                plan = self.router.plan(parsed.prompt_tokens, parsed.affinity_key)
                deadline_s = started_s + self.settings.request_deadline_s
                upstream = UpstreamRequest(
                    method="POST",
                    path=path,
                    body=parsed.upstream_body,
                    headers=self._upstream_headers(key, request_id, has_body=True),
                    is_stream=True,  # a non-stream's answer is assembled from it
                )
                tier: Tier = "region"
                if self.auto is not None and self.auto.is_auto(parsed):
                    opened, tier = await self.auto.open(
                        proxy, upstream, parsed, key, plan, deadline_s
                    )
                else:
                    opened = await proxy.open(upstream, plan, deadline_s)
            except BaseException:
                await limiter.settle(key, admission, parsed.reserved_tokens)
                raise
        except GatewayError as exc:
            return self._refuse(request, exc, key, request_id, started_s)
        region = opened.candidate.region
        headers = {HEADER: request_id, **self._where(region, tier), **admission.headers()}
        if opened.status != 200:
            return await self._answer_whole(
                request, opened, key, admission, parsed, headers, started_s
            )
        reader = StreamReader(
            strip_usage=parsed.is_stream and not parsed.wants_usage,
            strip_token_ids=not parsed.wants_token_ids,
        )
        on_end = partial(self._end_stream, request, key, admission, parsed, started_s)
        resumer = None
        if self.settings.max_resumes:
            resumer = Resumer(
                proxy,
                self.router,
                self.metrics,
                upstream,
                parsed.prompt_tokens,
                parsed.affinity_key,
            )
            if self.settings.resume_prewarm and tier == "region":
                self._prewarm(proxy, upstream, region, parsed)
        relay = StreamRelay(opened, reader, on_end, self.silence, resumer)
        if parsed.is_stream:
            return await relay.run(request, headers)
        sink = BodySink()
        await relay.collect(sink)
        headers[REGION_HEADER] = relay.opened.candidate.region  # a resumed one's: where it ended
        status, answer = self._whole_answer(relay, sink, headers, request_id)
        num_used = self._num_used(parsed, relay.reader)
        region, num_retries = relay.opened.candidate.region, relay.first.num_retries
        self._count_and_log(request, status, region, key, started_s, num_retries, num_used)
        return answer

    def _whole_answer(
        self, relay: StreamRelay, sink: BodySink, headers: dict[str, str], request_id: str
    ) -> tuple[int, web.Response]:
        """A non-stream's answer, from its relayed stream: the body, or why there is none."""
        if relay.error is not None:
            # As when a region fails before answering and no other one can (no resume).
            error = UpstreamError("no region could be reached", "upstream_unreachable")
        else:
            try:
                body = whole_body(sink.events)
            except ValueError:
                error = UpstreamError("the region's answer could not be read", "stream_interrupted")
            else:
                headers = {**headers, "content-type": "application/json"}
                return 200, web.Response(body=body, status=200, headers=headers)
        answer = error_response(error, {HEADER: request_id, POP_HEADER: self.settings.pop})
        return answer.status, answer

    async def _answer_whole(
        self,
        request: web.Request,
        opened: Opened,
        key: ApiKey,
        admission: Admission,
        parsed: ParsedRequest,
        headers: dict[str, str],
        started_s: float,
    ) -> web.StreamResponse:
        opened.finish()
        region, status = opened.candidate.region, opened.status
        self.metrics.observe_ttft(region, "whole", time.monotonic() - opened.sent_at_s)
        num_used = 0  # a refused request used nothing
        if status == 200:
            try:
                usage = usage_of(json.loads(opened.body))
            except ValueError:
                usage = None
            num_used = usage.total_tokens if usage else parsed.reserved_tokens
        await self._limiter().settle(key, admission, parsed.reserved_tokens - num_used)
        self._count_and_log(request, status, region, key, started_s, opened.num_retries, num_used)
        return web.Response(
            body=opened.body, status=status, headers={**headers, **opened.passed_headers()}
        )

    async def _end_stream(
        self,
        request: web.Request,
        key: ApiKey,
        admission: Admission,
        parsed: ParsedRequest,
        started_s: float,
        relay: StreamRelay,
    ) -> None:
        first, candidate = relay.first.candidate, relay.opened.candidate
        if relay.ttft_s is not None:
            if parsed.is_stream:
                self.metrics.observe_ttft(first.region, "stream", relay.ttft_s)
                # The first attempt's prefix-cache hits, where its usage is the one read.
                usage = relay.reader.usage
                cached = usage.cached_tokens if usage and not relay.reader.num_resumes else 0
                self.router.observe_ttft(
                    first.region, relay.ttft_s, first.predicted_ttft_s, cached_tokens=cached
                )
            else:  # as before: a non-stream's TTFT is its whole answer's, and not the router's
                whole_s = time.monotonic() - relay.first.sent_at_s
                self.metrics.observe_ttft(first.region, "whole", whole_s)
        for resume in relay.resumes:
            if resume.first_chunk_s is None or resume.gap_s is None:
                continue  # the continuation sent nothing the client saw
            self.metrics.observe_resume_gap(candidate.region, resume.gap_s)
            reopen_s = resume.reopened_s - resume.detected_s
            self.metrics.observe_resume_latency(candidate.region, "reopen", reopen_s)
            first_chunk_s = resume.first_chunk_s - resume.detected_s
            self.metrics.observe_resume_latency(candidate.region, "first_chunk", first_chunk_s)
        num_used = self._num_used(parsed, relay.reader)
        await self._limiter().settle(key, admission, parsed.reserved_tokens - num_used)
        if relay.error is not None:
            self.metrics.count_stream_error(candidate.region)
            state = self.router.state_of(candidate.region)
            if state is not None:
                state.breaker.on_failure(time.monotonic())
        if parsed.is_stream or relay.is_client_gone:  # else `_complete` logs the answer it built
            status = 499 if relay.is_client_gone else 200
            self._count_and_log(
                request,
                status,
                candidate.region,
                key,
                started_s,
                relay.first.num_retries,
                num_used,
            )

    def _prewarm(
        self, proxy: Proxy, upstream: UpstreamRequest, region: str, parsed: ParsedRequest
    ) -> None:
        warm = prewarm(
            proxy,
            self.router,
            self.metrics,
            upstream,
            region,
            parsed.prompt_tokens,
            parsed.affinity_key,
        )
        task = asyncio.create_task(warm)
        self._prewarms.add(task)
        task.add_done_callback(self._prewarms.discard)

    @staticmethod
    def _num_used(parsed: ParsedRequest, reader: StreamReader) -> int:
        """The tokens a stream used: its usage (summed over attempts), else an estimate."""
        if reader.usage is not None:
            return reader.usage.total_tokens
        # Cut short: the prompt (at its bound, as reserved) once per attempt, and the tokens
        # relayed.
        num_prompts = parsed.max_prompt_tokens * len(reader.starts) + sum(reader.starts)
        num_relayed = max(len(reader.token_ids), reader.num_events)
        return min(parsed.reserved_tokens, num_prompts + num_relayed)

    # Helpers.

    def _where(self, region: str, tier: Tier) -> dict[str, str]:
        """The headers that say where a request went."""
        return {POP_HEADER: self.settings.pop, REGION_HEADER: region, TIER_HEADER: tier}

    def _upstream_headers(self, key: ApiKey, request_id: str, has_body: bool) -> dict[str, str]:
        """Built afresh: the client's headers (its API key above all) never reach a node."""
        headers = {HEADER: request_id}
        if has_body:
            headers["content-type"] = "application/json"
        authorization = self.settings.serving_authorization
        if authorization is not None:
            headers["authorization"] = authorization
        if not self.settings.share_prefix_cache:
            headers[CACHE_SALT_HEADER] = cache_salt_of(key.id)
        return headers

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

    async def _read_body(self, request: web.Request) -> bytes:
        max_bytes = self.settings.max_body_bytes
        length = request.content_length
        if length is not None and length > max_bytes:
            raise BodyTooLargeError(f"request body over {max_bytes} bytes", "body_too_large")
        try:  # the application's client_max_size bounds bodies sent without a length
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLargeError(
                f"request body over {max_bytes} bytes", "body_too_large"
            ) from None

    def _refuse(
        self,
        request: web.Request,
        exc: GatewayError,
        key: ApiKey | None,
        request_id: str,
        started_s: float,
    ) -> web.StreamResponse:
        self._count_and_log(request, exc.status_code, NO_REGION, key, started_s, 0)
        return error_response(exc, {HEADER: request_id, POP_HEADER: self.settings.pop})

    def _count_and_log(
        self,
        request: web.Request,
        status: int,
        region: str,
        key: ApiKey | None,
        started_s: float,
        num_retries: int,
        num_tokens: int = 0,
    ) -> None:
        key_id = key.id if key is not None else NO_KEY
        self.metrics.count_request(region, status, key_id)
        if self.settings.access_log:
            access_logger.info(
                "%s %s %d region=%s key=%s retries=%d tokens=%d %.1fms",
                request.method,
                request.path,
                status,
                region,
                key_id,
                num_retries,
                num_tokens,
                (time.monotonic() - started_s) * 1000,
            )
