"""Relaying a committed upstream SSE stream to the client, chunk by chunk, without buffering.

Each upstream read is forwarded as soon as it holds whole events. If the upstream fails or goes
quiet after bytes were sent, the client gets an SSE error event and `[DONE]` (never a silent
cut). If the client goes away (a failed write, or the server cancelling the handler when the
connection drops), the upstream request is closed at once so the node stops generating.
However the stream ends, `on_end` runs once with what was learnt (usage, TTFT, error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from gateway.errors import sse_error_event
from gateway.proxy import Opened
from gateway.sse import StreamReader

logger = logging.getLogger(__name__)

SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}


class StreamRelay:
    def __init__(
        self,
        opened: Opened,
        reader: StreamReader,
        on_end: Callable[[StreamRelay], Awaitable[None]],
    ) -> None:
        self.opened = opened
        self.reader = reader
        self._on_end = on_end
        self.ttft_s: float | None = None
        self.error: str | None = None  # why the stream ended early, if it did
        self.is_client_gone = False
        self._has_read_all = False

    async def run(self, request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
        try:
            await response.prepare(request)
            await self._pump(response)
        except ConnectionResetError:
            self.is_client_gone = True
        except BaseException:  # cancelled: the client's connection dropped
            self.is_client_gone = True
            raise
        finally:
            if not self._has_read_all:
                self.opened.response.close()  # stop the node generating for nobody
            self.opened.finish()
            await self._on_end(self)
        return response

    async def _pump(self, response: web.StreamResponse) -> None:
        await self._forward(self.opened.body, response)
        content = self.opened.response.content
        while True:
            try:
                chunk = await content.readany()
            except TimeoutError:
                self.error = "the region stopped sending"
                break
            except aiohttp.ClientError as exc:
                self.error = f"the region failed mid-stream ({type(exc).__name__})"
                break
            if not chunk:
                self._has_read_all = True
                if not self.reader.is_done:
                    self.error = "the region ended the stream early"
                break
            await self._forward(chunk, response)
        tail = self.reader.flush()
        if tail:
            await response.write(tail)
        if self.error is not None:
            logger.warning(
                "stream from %s ended early: %s", self.opened.candidate.region, self.error
            )
            message = f"{self.error}; the response is incomplete"
            await response.write(sse_error_event(502, message, "stream_interrupted"))
        await response.write_eof()

    async def _forward(self, chunk: bytes, response: web.StreamResponse) -> None:
        out = self.reader.feed(chunk)
        if self.ttft_s is None and self.reader.has_first_token:
            self.ttft_s = time.monotonic() - self.opened.sent_at_s
        if out:
            await response.write(out)
