"""Sending a request upstream: one region after another until one answers (failover).

An attempt fails over to the next region in the plan when, before the client has seen a byte, the
connection fails, the region does not answer in time, or it answers 5xx or 429. "In time" is the
first-byte timeout: a stream's first token, or a non-stream's whole answer (the timeout plus its
max_tokens at the slowest decode rate expected). The last place a request may ask (the last region
of its last model) has nowhere to fail over to: it is waited on past the timeout, up to the
request's deadline, while the summary shows it a healthy node (`waits_past_timeout`). A non-stream
is read whole before anything is sent to the client, so any failure while reading it still fails
over; a stream is committed once its first token arrives: a chat stream's opening role chunk does
not count (the node sends it before its engine has done anything, so a node whose engine is stopped
sends it too), and an error event in the place of the first token fails over as a 5xx does. Every
completion goes upstream as a stream, a non-streamed one too (its body is assembled by
gateway/whole.py), so that it can resume.
Other statuses (400, 404, 413, 422, ...) are the node's judgement of the request itself: they
go back to the client as they are, are not retried elsewhere (every region would say the same)
and count as the region's success, never towards opening its breaker. Every attempt feeds the
region's circuit breaker (but a 429 with DEFLECTED_HEADER: the region's picker sent the request
back to try the next-best region, which the first attempt tells it the cost of:
wire/deflection.py); all of them together stay within the request's deadline and
`max_attempts`. When every region failed with a status,
the last such answer goes back to the client (a 429 keeps its Retry-After); when none answered
at all, 502 (504 if the deadline passed first). Which region comes next is decided by the pure
`AttemptSequence` (gateway/attempts.py); this module does the I/O. A committed stream that breaks
later is continued through `resume` with the same sequence (see gateway/resume.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

import aiohttp
from yarl import URL

from gateway.attempts import (
    AttemptLimits,
    AttemptSequence,
    ConnectTimeout,
    GiveUp,
    Try,
    waits_past_timeout,
)
from gateway.errors import DeadlineError, NoCapacityError, UpstreamError
from gateway.metrics import GatewayMetrics
from gateway.region_state import RegionState
from gateway.routing import Candidate, RoutePlan, Router
from gateway.settings import GatewaySettings
from gateway.sse import DATA_PREFIX, ERROR_PREFIX, EVENT_END, first_output
from gateway.upstream_request import UpstreamRequest
from wire.deflection import ALTERNATIVE_HEADER, DEFLECTED_HEADER, alternative_header
from wire.heartbeat import NODE_ID_HEADER
from wire.upstream_url import join_path

# Distinct (region URL, path) pairs are few: each one's URL is built and parsed once, not per
# request (measured: about 3% of the CPU of a proxied request).
MAX_CACHED_URLS = 1024


@lru_cache(maxsize=MAX_CACHED_URLS)
def _upstream_url(base: str, path: str) -> URL:
    return URL(join_path(base, path))


@lru_cache(maxsize=MAX_CACHED_URLS)  # one a region (its RTT), not one a request
def _client_timeout(connect_s: float) -> aiohttp.ClientTimeout:
    # Past the first byte, the relay bounds a stream's silence (gateway/relay.py).
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_s)


logger = logging.getLogger(__name__)


class _Patience:
    """Holds an attempt's timer (set at the request's deadline) past the first-byte timeout
    while `waits()` says so, asking again every `every_s`; fires it at the first no."""

    def __init__(
        self, timer: asyncio.Timeout, waits: Callable[[], bool], after_s: float, every_s: float
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._timer, self._waits, self._every_s = timer, waits, every_s
        self._handle = self._loop.call_later(after_s, self._ask)

    def _ask(self) -> None:
        if self._waits():
            self._handle = self._loop.call_later(self._every_s, self._ask)
        else:
            self._timer.reschedule(self._loop.time())

    def cancel(self) -> None:
        self._handle.cancel()


def _waits_past_timeout(step: Try, state: RegionState | None) -> bool:
    return waits_past_timeout(step, None if state is None else state.summary)


# Headers from the node worth passing on to the client (hop-by-hop ones are not).
PASSED_HEADERS = ("content-type", "retry-after", "retry-after-ms")


def _is_deflection(response: aiohttp.ClientResponse) -> bool:
    return response.status == 429 and DEFLECTED_HEADER in response.headers


@dataclass(slots=True)
class Opened:
    """An upstream answer the gateway has committed to."""

    candidate: Candidate
    state: RegionState | None
    response: aiohttp.ClientResponse
    # The whole body (non-streams, errors), or a 200 stream's bytes up to its first token.
    body: bytes
    sent_at_s: float  # when the attempt that answered started
    num_retries: int
    answered_at_s: float  # when its response headers came (monotonic seconds)
    attempts: AttemptSequence | None = None  # what else this request may try (for resumes)

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def node(self) -> str | None:
        """The node that answered, as it names itself (None: it did not say)."""
        return self.response.headers.get(NODE_ID_HEADER)

    def passed_headers(self) -> dict[str, str]:
        headers = self.response.headers
        return {name: headers[name] for name in PASSED_HEADERS if name in headers}

    def finish(self) -> None:
        """Release the connection (to the pool if the body was read, else closed)."""
        if self.state is not None:
            self.state.num_in_flight -= 1
        self.response.release()


class ErrorBeforeFirstTokenError(aiohttp.ClientError):
    """The stream's first event past its role chunk is an error event: it never began."""


def _cause_of(exc: BaseException) -> str:
    if isinstance(exc, ErrorBeforeFirstTokenError):
        return "error_event"
    return "timeout" if isinstance(exc, TimeoutError) else "connect"


async def _read_to_first_token(content: aiohttp.StreamReader) -> bytes:
    """A stream's bytes up to the read that completed its first token's event."""
    parts: list[bytes] = []
    pending = b""  # what follows the last whole event looked at
    while True:
        chunk = await content.readany()
        if not chunk:
            raise aiohttp.ServerDisconnectedError("the stream ended before its first token")
        parts.append(chunk)
        pending += chunk
        event = first_output(pending)
        if event is not None and event.startswith(ERROR_PREFIX):
            raise ErrorBeforeFirstTokenError(
                event[len(DATA_PREFIX) :][:200].decode(errors="replace")
            )
        if event is not None:
            return b"".join(parts)
        cut = pending.rfind(EVENT_END)
        if cut >= 0:
            pending = pending[cut + len(EVENT_END) :]


class Proxy:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        router: Router,
        metrics: GatewayMetrics,
        settings: GatewaySettings,
    ) -> None:
        self._session = session
        self._router = router
        self._metrics = metrics
        self._limits = AttemptLimits(settings.max_attempts, settings.max_resumes)
        self._first_byte_timeout_s = settings.first_byte_timeout_s
        self._min_decode_tokens_per_s = settings.min_decode_tokens_per_s
        self._recheck_s = settings.unhealthy_node_silence_s
        self._connect_timeout = ConnectTimeout(
            settings.connect_timeout_rtts,
            settings.min_connect_timeout_s,
            settings.connect_timeout_s,
        )

    def _first_byte_timeout_s_of(self, request: UpstreamRequest) -> float:
        if request.is_stream:
            return self._first_byte_timeout_s
        return self._first_byte_timeout_s + request.max_tokens / self._min_decode_tokens_per_s

    async def open(
        self,
        request: UpstreamRequest,
        plan: RoutePlan,
        deadline_s: float,
        is_last_resort: bool = False,
    ) -> Opened:
        """`is_last_resort`: no other model is tried after these regions."""
        if not plan.candidates:
            raise NoCapacityError(
                "no region can take requests now", "no_capacity", headers={"retry-after": "1"}
            )
        self._metrics.count_decision(plan.candidates[0].region, plan.reason)
        attempts = AttemptSequence(
            plan.candidates, self._limits, deadline_s, is_last_resort, plan.alternative_s
        )
        return await self._open_next(request, attempts)

    async def resume(self, request: UpstreamRequest, attempts: AttemptSequence) -> Opened:
        """Open `request` (a continuation) on the regions `attempts` has not tried yet; the
        caller has had `attempts.resume` allow it. Raises GatewayError as `open` does."""
        return await self._open_next(request, attempts)

    async def send_aside(self, request: UpstreamRequest, candidate: Candidate) -> str:
        """One attempt at `candidate` whose answer nobody waits for (a prewarm): read whole and
        dropped, outside the region's breaker and in-flight counts. Returns "ok", the HTTP
        status, or why no answer came ("timeout", "connect")."""
        try:
            opened = await self._attempt(request, candidate, self._first_byte_timeout_s_of(request))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _cause_of(exc)
        opened.finish()
        return "ok" if opened.status == 200 else str(opened.status)

    async def _open_next(self, request: UpstreamRequest, attempts: AttemptSequence) -> Opened:
        last_answer: Opened | None = None
        num_retries = 0
        while True:
            now_s = time.monotonic()
            step = attempts.next(now_s)
            if isinstance(step, GiveUp):
                break
            candidate, awaited = step.candidate, step.awaited_tokens
            state = self._router.state_of(candidate.region)
            if state is not None:
                state.breaker.on_attempt(now_s)
                state.on_sent(awaited)
            waits = partial(_waits_past_timeout, step, state) if step.is_last else None
            sent, alternative_s = request, step.alternative_s
            if alternative_s is not None:
                sent = request.with_header(ALTERNATIVE_HEADER, alternative_header(alternative_s))
            try:
                opened = await self._attempt(sent, candidate, attempts.deadline_s - now_s, waits)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._on_failure(step, state, _cause_of(exc), repr(exc))
                num_retries += 1
                continue
            except BaseException:  # cancelled: the client went away
                if state is not None:
                    state.on_no_first_byte(awaited)
                    state.breaker.on_abandon()
                raise
            opened.state, opened.sent_at_s, opened.num_retries = state, now_s, num_retries
            opened.attempts = attempts
            # Only an attempt told an alternative may be sent back (else a 429 like any other).
            if alternative_s is not None and _is_deflection(opened.response):
                opened.response.release()
                self._on_deflected(step, state)
                attempts.deflected()
                num_retries += 1
                continue
            if opened.status >= 500 or opened.status == 429:
                opened.response.release()
                self._on_failure(step, state, str(opened.status), f"HTTP {opened.status}")
                opened.state = None  # counted out already
                num_retries += 1
                last_answer = opened
                continue
            if state is not None:
                state.on_first_byte(awaited)
                state.breaker.on_success()
            return opened
        if last_answer is not None:
            return last_answer
        if time.monotonic() >= attempts.deadline_s:
            raise DeadlineError("no region answered within the request's deadline", "timeout")
        raise UpstreamError("no region could be reached", "upstream_unreachable")

    async def _attempt(
        self,
        request: UpstreamRequest,
        candidate: Candidate,
        remaining_s: float,
        waits: Callable[[], bool] | None = None,
    ) -> Opened:
        """`waits`: whether to wait on past the first-byte timeout, asked from then on (None: the
        attempt has somewhere left to fail over to)."""
        timeout_s = min(remaining_s, self._first_byte_timeout_s_of(request))
        if waits is None or remaining_s <= timeout_s:
            async with asyncio.timeout(timeout_s):
                return await self._first_byte(request, candidate)
        async with asyncio.timeout(remaining_s) as timer:
            patience = _Patience(timer, waits, timeout_s, self._recheck_s)
            try:
                return await self._first_byte(request, candidate)
            finally:
                patience.cancel()

    async def _first_byte(self, request: UpstreamRequest, candidate: Candidate) -> Opened:
        response = await self._session.request(
            request.method,
            _upstream_url(candidate.url, request.path),
            data=request.data,
            headers=request.headers,
            timeout=_client_timeout(self._connect_timeout.of(candidate.rtt_ms)),
        )
        answered_at_s = time.monotonic()
        try:
            if request.is_stream and response.status == 200:
                first = await _read_to_first_token(response.content)
            else:
                first = await response.read()
        except BaseException:
            response.close()
            raise
        return Opened(candidate, None, response, first, 0.0, 0, answered_at_s)

    def _on_deflected(self, step: Try, state: RegionState | None) -> None:
        """The region's picker sent the request back: the region answered, and works."""
        if state is not None:
            state.on_no_first_byte(step.awaited_tokens)
            state.breaker.on_success()
        self._metrics.count_retry(step.candidate.region, "deflected")

    def _on_failure(self, step: Try, state: RegionState | None, cause: str, detail: str) -> None:
        if state is not None:
            state.on_no_first_byte(step.awaited_tokens)
            state.breaker.on_failure(time.monotonic())
        region = step.candidate.region
        self._metrics.count_retry(region, cause)
        logger.warning("region %s failed before the first byte (%s)", region, detail)
