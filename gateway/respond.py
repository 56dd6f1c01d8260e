"""The relay step of a completion: the opened answer to the client, whole or streamed (with
resumes, and a prewarm where asked), then the reservation settled from the usage and the call
recorded. An answer other than 200 is the node's judgement and goes back as it came. Every
answer names the model that answered in MODEL_HEADER (a fallback's name when one did), as its
body's `model` does: the node writes the name the body sent upstream said."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial

from aiohttp import web

from gateway.admit import Admitted
from gateway.calls import REGION_HEADER, Call, CallLog
from gateway.dispatch import Routed
from gateway.errors import UpstreamError
from gateway.limit_shares import PopLimiter
from gateway.metrics import GatewayMetrics
from gateway.openai_request import ParsedRequest
from gateway.prewarm import prewarm
from gateway.proxy import Opened, Proxy
from gateway.relay import SilenceLimits, StreamRelay
from gateway.request_ids import HEADER
from gateway.resume import Resumer, ResumeTargets
from gateway.routing import Router
from gateway.settings import GatewaySettings
from gateway.sse import StreamReader
from gateway.whole import BodySink, whole_body
from wire.model_catalog import MODEL_HEADER


def num_used(parsed: ParsedRequest, reader: StreamReader) -> int:
    """The tokens a stream used: its usage (summed over attempts), else an estimate."""
    if reader.usage is not None:
        return reader.usage.total_tokens
    # Cut short: the prompt (at its bound, as reserved) once per attempt, and the tokens relayed.
    num_prompts = parsed.max_prompt_tokens * len(reader.starts) + sum(reader.starts)
    num_relayed = max(len(reader.token_ids), reader.num_events)
    return min(parsed.reserved_tokens, num_prompts + num_relayed)


@dataclass(slots=True)
class Respond:
    settings: GatewaySettings
    router: Router
    metrics: GatewayMetrics
    log: CallLog
    silence: SilenceLimits = field(init=False)  # every stream's, from the settings and router
    _prewarms: set[asyncio.Task[None]] = field(default_factory=set, init=False)  # while running

    def __post_init__(self) -> None:
        self.silence = SilenceLimits(
            self.settings.stream_idle_timeout_s,
            self.settings.unhealthy_node_silence_s,
            self.router.summary_of,
        )

    async def __call__(
        self, proxy: Proxy, limiter: PopLimiter, call: Call, admitted: Admitted, routed: Routed
    ) -> web.StreamResponse:
        opened = routed.opened
        where = self.log.where(opened.candidate.region, routed.tier)
        headers = {
            HEADER: call.request_id,
            MODEL_HEADER: routed.model,
            **where,
            **admitted.admission.headers(),
        }
        if opened.status != 200:
            return await self._answer_whole(limiter, call, admitted, opened, headers)
        relay = self._relay(proxy, limiter, call, admitted, routed)
        if admitted.parsed.is_stream:
            return await relay.run(call.request, headers)
        return await self._collect(relay, call, admitted, headers)

    def _relay(
        self, proxy: Proxy, limiter: PopLimiter, call: Call, admitted: Admitted, routed: Routed
    ) -> StreamRelay:
        parsed = admitted.parsed
        reader = StreamReader(
            strip_usage=parsed.is_stream and not parsed.wants_usage,
            strip_token_ids=not parsed.wants_token_ids,
            num_choices=parsed.num_choices,
        )
        on_end = partial(self._end_stream, limiter, call, admitted, routed.model)
        resumer = None
        if self.settings.max_resumes:
            targets = ResumeTargets.of(self.router, parsed, routed)
            resumer = Resumer(proxy, self.metrics, routed.upstream, parsed.prompt_tokens, targets)
            if self.settings.resume_prewarm and routed.tier == "region":
                self._prewarm(proxy, routed, parsed.prompt_tokens, targets)
        return StreamRelay(routed.opened, reader, on_end, self.silence, resumer)

    async def _collect(
        self, relay: StreamRelay, call: Call, admitted: Admitted, headers: dict[str, str]
    ) -> web.Response:
        """A non-stream's answer, assembled from its relayed stream."""
        sink = BodySink()
        await relay.collect(sink)
        region = relay.opened.candidate.region  # a resumed one's: where it ended
        headers[REGION_HEADER] = region
        status, answer = self._whole_answer(relay, sink, headers, call)
        num_tokens = num_used(admitted.parsed, relay.reader)
        self.log.record(call, status, region, relay.first.num_retries, num_tokens)
        return answer

    def _whole_answer(
        self, relay: StreamRelay, sink: BodySink, headers: dict[str, str], call: Call
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
        answer = self.log.error(call, error)
        return answer.status, answer

    async def _answer_whole(
        self,
        limiter: PopLimiter,
        call: Call,
        admitted: Admitted,
        opened: Opened,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """An answer other than 200, read whole by the proxy: the node's, as it gave it."""
        opened.finish()
        region, status = opened.candidate.region, opened.status
        self.metrics.observe_ttft(region, "whole", time.monotonic() - opened.sent_at_s)
        # A refused request used nothing.
        await limiter.settle(admitted.key, admitted.admission, admitted.parsed.reserved_tokens)
        self.log.record(call, status, region, opened.num_retries)
        return web.Response(
            body=opened.body, status=status, headers={**headers, **opened.passed_headers()}
        )

    async def _end_stream(
        self,
        limiter: PopLimiter,
        call: Call,
        admitted: Admitted,
        answered: str,
        relay: StreamRelay,
    ) -> None:
        """`answered`: the model that answered (a fallback's, when one did): the spend is its."""
        parsed = admitted.parsed
        candidate = relay.opened.candidate
        self._observe_latencies(parsed, relay)
        num_tokens = num_used(parsed, relay.reader)
        unused = parsed.reserved_tokens - num_tokens
        await limiter.settle(admitted.key, admitted.admission, unused, answered)
        if relay.error is not None:
            self.metrics.count_stream_error(candidate.region)
            state = self.router.state_of(candidate.region)
            if state is not None:
                state.breaker.on_failure(time.monotonic())
        if parsed.is_stream or relay.is_client_gone:  # else `_collect` records the answer
            status = 499 if relay.is_client_gone else 200
            num_retries = relay.first.num_retries
            self.log.record(call, status, candidate.region, num_retries, num_tokens)

    def _observe_latencies(self, parsed: ParsedRequest, relay: StreamRelay) -> None:
        """The stream's TTFT (to the metrics and, for free streams, the router) and its
        resumes'."""
        first, candidate = relay.first.candidate, relay.opened.candidate
        if relay.ttft_s is not None:
            if not parsed.is_stream:  # a non-stream's TTFT is its whole answer's: not the router's
                whole_s = time.monotonic() - relay.first.sent_at_s
                self.metrics.observe_ttft(first.region, "whole", whole_s)
            else:
                self.metrics.observe_ttft(first.region, "stream", relay.ttft_s)
                # A grammar's compile on the node (seconds the first time) is in its TTFT: the
                # router learning from it would judge the region slow for minutes.
                if not parsed.is_constrained:
                    # The first attempt's prefix-cache hits, where its usage is the one read.
                    usage = relay.reader.usage
                    cached = usage.cached_tokens if usage and not relay.reader.num_resumes else 0
                    self.router.observe_ttft(
                        first.region, relay.ttft_s, first.predicted_ttft_s, cached_tokens=cached
                    )
        for resume in relay.resumes:
            if resume.first_chunk_s is None or resume.gap_s is None:
                continue  # the continuation sent nothing the client saw
            self.metrics.observe_resume_gap(candidate.region, resume.gap_s)
            reopen_s = resume.reopened_s - resume.detected_s
            self.metrics.observe_resume_latency(candidate.region, "reopen", reopen_s)
            first_chunk_s = resume.first_chunk_s - resume.detected_s
            self.metrics.observe_resume_latency(candidate.region, "first_chunk", first_chunk_s)

    def _prewarm(
        self, proxy: Proxy, routed: Routed, prompt_tokens: int, targets: ResumeTargets
    ) -> None:
        home = routed.opened.candidate.region
        warm = prewarm(proxy, self.metrics, routed.upstream, home, prompt_tokens, targets)
        task = asyncio.create_task(warm)
        self._prewarms.add(task)
        task.add_done_callback(self._prewarms.discard)
