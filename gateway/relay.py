"""Relaying a committed upstream SSE stream to the client, chunk by chunk, without buffering.

Each upstream read is forwarded as soon as it holds whole events. If the upstream fails, goes
silent for longer than its limit (`SilenceLimits`), ends early or sends an error event after
bytes were sent, the relay asks `resume` for a continuation in another region and carries on
reading from it, the client seeing one stream (gateway/resume.py, gateway/sse.py). When no
continuation can be had, the client gets an SSE error event and `[DONE]` (the upstream's own
error event if it sent one; never a silent cut). If the client goes away (a failed write, or the
server cancelling the handler when the connection drops), the upstream request is closed at once
so the node stops generating. However the stream ends, `on_end` runs once with what was learnt
(usage, TTFT, error). A non-streamed request's internal stream is relayed the same way into a
buffer (`collect`; gateway/whole.py makes its body).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import aiohttp
from aiohttp import web

from gateway.errors import sse_error_event
from gateway.proxy import Opened
from gateway.sse import DONE_EVENT, EVENT_END, StreamReader
from wire.region_summary import RegionSummary

logger = logging.getLogger(__name__)

SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}

# Given the broken attempt and why it broke: a continuation already answering, or None.
Resume = Callable[[Opened, StreamReader, str], Awaitable[Opened | None]]


@dataclass(frozen=True, slots=True)
class SilenceLimits:
    """How long a stream may stay silent before it counts as broken: `idle_s`, but only
    `unhealthy_s` while the summary this gateway holds shows the stream's node among its
    region's unhealthy ones, or the region with no healthy node at all. A node (or the path to
    it) that hangs with the connection open stops its heartbeats as well, so the control plane
    tells the gateway within `unhealthy_after_s` that the silence will last, while the region's
    other nodes serve on; a stream still flowing from such a node is left alone (it is plainly
    alive). The simulator plays its streams' silences with the same limits (simulator/flow.py)."""

    idle_s: float
    unhealthy_s: float
    summary_of: Callable[[str], RegionSummary | None]  # a region's, as held (None: unknown)

    def of(self, region: str, node: str | None) -> float:
        """The limit for a stream from `node` (the node's own name for itself; None if it gave
        none) in `region`."""
        summary = self.summary_of(region)
        if summary is not None and (summary.healthy_nodes == 0 or node in summary.unhealthy_nodes):
            return self.unhealthy_s
        return self.idle_s


@dataclass(slots=True)
class ResumeTiming:
    """When one resume's steps happened (monotonic seconds): where a resume's latency goes."""

    last_chunk_s: float  # the broken attempt's last chunk to the client
    detected_s: float  # the break seen (connection ended, stall timeout, error event)
    reopened_s: float  # the continuation answered (its response headers)
    first_chunk_s: float | None = None  # its first chunk to the client

    @property
    def gap_s(self) -> float | None:
        """What the client saw: the last chunk before the break to the first after."""
        return None if self.first_chunk_s is None else self.first_chunk_s - self.last_chunk_s


class Sink(Protocol):
    """Where the relayed events go: the client's response, or a non-stream's buffer."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...


class StreamRelay:
    def __init__(
        self,
        opened: Opened,
        reader: StreamReader,
        on_end: Callable[[StreamRelay], Awaitable[None]],
        silence: SilenceLimits,
        resume: Resume | None = None,
    ) -> None:
        self.first = opened  # the attempt the stream began on (its TTFT, its retries)
        self.opened = opened  # the attempt being read now
        self.reader = reader
        self._on_end = on_end
        self._silence = silence
        self._resume = resume
        self.ttft_s: float | None = None
        self.error: str | None = None  # why the stream ended early, if it did
        self.is_client_gone = False
        self._has_read_all = False
        self.last_chunk_s = time.monotonic()  # when bytes last went to the client
        self._heard_s = self.last_chunk_s  # when the current attempt last sent bytes
        self.resumes: list[ResumeTiming] = []

    async def run(self, request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
        """Relay to the client's stream (its headers sent at once)."""
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
        await self._relay(response, partial(response.prepare, request))
        return response

    async def collect(self, sink: Sink) -> None:
        """Relay into `sink` instead of a client's stream (a non-stream's internal stream)."""
        await self._relay(sink)

    async def _relay(
        self, sink: Sink, prepare: Callable[[], Awaitable[object]] | None = None
    ) -> None:
        try:
            if prepare is not None:
                await prepare()
            await self._pump(sink)
        except ConnectionResetError:
            self.is_client_gone = True
        except BaseException:  # cancelled: the client's connection dropped
            self.is_client_gone = True
            raise
        finally:
            self._release()
            await self._on_end(self)

    def _release(self) -> None:
        if not self._has_read_all:
            self.opened.response.close()  # stop the node generating for nobody
        self.opened.finish()

    async def _pump(self, response: Sink) -> None:
        await self._forward(self.opened.body, response)
        while True:
            error = await self._read_attempt(response)
            if error is None:
                break
            if self.reader.is_finished:  # only the usage and `[DONE]` were lost
                await response.write(self.reader.end_without_usage() + DONE_EVENT + EVENT_END)
                break
            if self._resume is None:
                self.error = error
                break
            logger.warning("stream from %s broke: %s", self.opened.candidate.region, error)
            detected_s = time.monotonic()
            continuation = await self._resume(self.opened, self.reader, error)
            if continuation is None:
                self.error = error
                break
            self._release()
            self.opened, self._has_read_all = continuation, False
            self._heard_s = time.monotonic()
            self.reader.begin_continuation()
            self.resumes.append(
                ResumeTiming(self.last_chunk_s, detected_s, continuation.answered_at_s)
            )
            await self._forward(continuation.body, response)
        tail = self.reader.flush()
        if tail and self.error is None:
            await response.write(tail)
        if self.error is not None:
            logger.warning(
                "stream from %s ended early: %s", self.opened.candidate.region, self.error
            )
            held = self.reader.upstream_error
            if held is not None:
                await response.write(held)
            else:
                message = f"{self.error}; the response is incomplete"
                await response.write(sse_error_event(502, message, "stream_interrupted"))
        await response.write_eof()

    async def _read_attempt(self, response: Sink) -> str | None:
        """Relay the current attempt to its end: None if it ended well, else why it broke."""
        if self.reader.upstream_error is not None:
            return "the region sent an error event"
        content = self.opened.response.content
        while True:
            try:
                chunk = await self._next_bytes(content)
            except aiohttp.ClientError as exc:
                return f"the region failed mid-stream ({type(exc).__name__})"
            if chunk is None:
                return "the region went silent"
            self._heard_s = time.monotonic()
            if not chunk:
                self._has_read_all = True
                return None if self.reader.is_done else "the region ended the stream early"
            await self._forward(chunk, response)
            if self.reader.upstream_error is not None:
                return "the region sent an error event"

    async def _next_bytes(self, content: aiohttp.StreamReader) -> bytes | None:
        """The attempt's next bytes (b"" at its end), or None once it has been silent past its
        limit. The limit is looked up again every `unhealthy_s` of silence, so a node that
        turns unhealthy during a long one cuts it short."""
        # Bytes already buffered need no timer (a non-stream's whole answer mostly is).
        buffered = content.read_nowait()
        if buffered or content.at_eof():
            return buffered
        region, node = self.opened.candidate.region, self.opened.node
        while True:
            left_s = self._silence.of(region, node) - (time.monotonic() - self._heard_s)
            if left_s <= 0.0:
                return None
            try:
                async with asyncio.timeout(min(left_s, self._silence.unhealthy_s)):
                    return await content.readany()
            except TimeoutError:
                continue  # what was read stays buffered for the next `readany`

    async def _forward(self, chunk: bytes, response: Sink) -> None:
        out = self.reader.feed(chunk)
        if self.ttft_s is None and self.reader.has_first_token:
            self.ttft_s = time.monotonic() - self.first.sent_at_s
        if out:
            await response.write(out)
            self.last_chunk_s = time.monotonic()
            if self.resumes and self.resumes[-1].first_chunk_s is None:
                self.resumes[-1].first_chunk_s = self.last_chunk_s
