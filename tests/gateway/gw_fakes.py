"""A small, fast upstream speaking the OpenAI wire format as our node agent does, with knobs for
delay and failure; and a TCP forwarder that delays bytes by a simulated one-way latency.

Both run on an asyncio loop of the test harness; nothing here sleeps inside the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web

from wire.deflection import ALTERNATIVE_HEADER, DEFLECTED_HEADER
from wire.heartbeat import NODE_ID_HEADER

JSON = dict[str, object]
PROMPT_TOKENS = 7  # what the fake reports as prompt usage


@dataclass
class Behavior:
    """How a fake upstream answers; tests change these fields while it runs."""

    delay_s: float = 0.0  # before the response headers
    fail_status: int | None = None  # answer every request with this status
    num_fail_then_ok: int = 0  # answer this many requests with 500 first
    num_chunks: int = 3  # content chunks per stream (and completion tokens per response)
    chunk_delay_s: float = 0.0
    die_after_chunks: int | None = None  # drop the connection mid-stream after this many
    error_after_chunks: int | None = None  # send an error event mid-stream after this many
    stall_after_chunks: int | None = None  # go silent (connection open) after this many
    malformed_after_chunks: int | None = None  # send an event that is not JSON after this many
    die_after_finish: bool = False  # drop the connection after the finish, before the usage
    put_usage_in_last_choice: bool = False
    cached_tokens: int = 0  # prompt tokens it reports as found in its prefix cache
    # Send requests back (429 + DEFLECTED_HEADER): "told", those told an alternative, as a
    # region's picker with busy nodes does; "all", every one (a region gone wrong).
    deflects: str | None = None


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: JSON


@dataclass
class FakeUpstream:
    name: str
    node_id: str  # named on every answer, as the node agent names itself
    # The model it serves: a request for another is refused with 404, as the node agent does
    # (None: it answers any).
    model: str | None = None
    behavior: Behavior = field(default_factory=Behavior)
    seen: list[Seen] = field(default_factory=list)
    num_abandoned: int = 0  # streams whose reader went away before the end
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def num_requests(self) -> int:
        return len(self.seen)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Kill: stop listening and drop every open connection."""
        if self._runner is not None:
            server = self._runner.server
            if server is not None:
                for protocol in list(server.connections):
                    transport = protocol.transport
                    if transport is not None:
                        transport.abort()
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, request: web.Request) -> web.Response:
        self.seen.append(Seen(request.path, _lower(request.headers), {}))
        body = {
            "object": "list",
            "data": [{"id": self.model or "fake-model", "object": "model", "owned_by": self.name}],
        }
        return web.json_response(body)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, _lower(request.headers), body))
        if self.model is not None and body.get("model") != self.model:
            error = {"error": {"message": "no such model", "type": "x", "code": "model_not_found"}}
            return web.json_response(error, status=404)
        behavior = self.behavior
        if behavior.delay_s:
            await asyncio.sleep(behavior.delay_s)
        told = ALTERNATIVE_HEADER in request.headers
        if behavior.deflects == "all" or (behavior.deflects == "told" and told):
            error = {"error": {"message": "sent back", "type": "x", "code": "deflected"}}
            return web.json_response(error, status=429, headers={DEFLECTED_HEADER: "picker"})
        status = behavior.fail_status
        if behavior.num_fail_then_ok > 0:
            behavior.num_fail_then_ok -= 1
            status = 500
        if status is not None:
            error = {"error": {"message": f"{self.name} fails", "type": "x", "code": "fake"}}
            headers = {"Retry-After": "1"} if status == 429 else None
            return web.json_response(error, status=status, headers=headers)
        is_chat = request.path.endswith("/chat/completions")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        num_tokens = min(behavior.num_chunks, int(max_tokens))
        if body.get("stream"):
            # Token i is "t{i} " with id 100 + i; a resumed request goes on after its ids.
            resumed = body.get("resume_token_ids") or []
            assert isinstance(resumed, list)
            start = len(resumed)
            num_new = min(behavior.num_chunks - start, int(max_tokens))
            return await self._stream(request, body, is_chat, start, num_new)
        headers = {NODE_ID_HEADER: self.node_id}
        return web.json_response(self._whole(is_chat, num_tokens, body), headers=headers)

    def _whole(self, is_chat: bool, num_tokens: int, body: JSON) -> JSON:
        text = "".join(f"t{i} " for i in range(num_tokens))
        usage = _usage(num_tokens)
        if is_chat:
            choice: JSON = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
            return {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": body.get("model"),
                "choices": [choice],
                "usage": usage,
                "served_by": self.name,
            }
        choice = {"index": 0, "text": text, "finish_reason": "stop"}
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": body.get("model"),
            "choices": [choice],
            "usage": usage,
            "served_by": self.name,
        }

    async def _stream(
        self, request: web.Request, body: JSON, is_chat: bool, start: int, num_tokens: int
    ) -> web.StreamResponse:
        try:
            return await self._write_stream(request, body, is_chat, start, num_tokens)
        except (ConnectionResetError, asyncio.CancelledError):
            self.num_abandoned += 1
            raise

    async def _write_stream(
        self, request: web.Request, body: JSON, is_chat: bool, start: int, num_tokens: int
    ) -> web.StreamResponse:
        behavior = self.behavior
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        with_ids = body.get("return_token_ids") is True
        headers = {"Content-Type": "text/event-stream", NODE_ID_HEADER: self.node_id}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        base: JSON = {
            "id": f"chunk-{self.name}-{len(self.seen)}",
            "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": len(self.seen),
            "model": body.get("model"),
            "served_by": self.name,
        }

        # As the node agent: with ids asked for, the first chunk says what was prefilled.
        resumed = body.get("resume_token_ids") or []
        assert isinstance(resumed, list)
        prompt_ids = [7] * PROMPT_TOKENS + resumed
        is_first = [with_ids]

        def chunk(choice: JSON) -> bytes:
            payload: JSON = {**base}
            if is_first[0]:
                payload["prompt_token_ids"] = prompt_ids
                is_first[0] = False
            payload["choices"] = [choice]
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        if is_chat:
            await response.write(
                chunk(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                )
            )
        for n, i in enumerate(range(start, start + num_tokens)):
            if behavior.die_after_chunks is not None and n >= behavior.die_after_chunks:
                assert request.transport is not None
                request.transport.abort()
                return response
            if behavior.error_after_chunks is not None and n >= behavior.error_after_chunks:
                error = {"error": {"message": "engine died", "type": "x", "code": "engine_dead"}}
                await response.write(_sse(error) + b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            if behavior.stall_after_chunks is not None and n >= behavior.stall_after_chunks:
                await asyncio.sleep(3600)
            if n == behavior.malformed_after_chunks:
                await response.write(b'data: {"id": "chunk", "choices": [\n\n')
            if behavior.chunk_delay_s:
                await asyncio.sleep(behavior.chunk_delay_s)
            text = f"t{i} "
            choice = (
                {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
            )
            if with_ids:
                choice["token_ids"] = [100 + i]
            await response.write(chunk({**choice, "finish_reason": None}))
        final: JSON = {"index": 0, "finish_reason": "stop"}
        final |= {"delta": {}} if is_chat else {"text": ""}
        usage = _usage(num_tokens, PROMPT_TOKENS + start, behavior.cached_tokens)
        if include_usage and behavior.put_usage_in_last_choice:
            await response.write(_sse({**base, "choices": [final], "usage": usage}))
        else:
            await response.write(chunk(final))
            if behavior.die_after_finish:
                assert request.transport is not None
                request.transport.abort()
                return response
            if include_usage:
                await response.write(_sse({**base, "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def _usage(num_tokens: int, num_prompt_tokens: int = PROMPT_TOKENS, cached: int = 0) -> JSON:
    """A resumed request counts the ids it resumed after as prompt, as our node agent does;
    prefix-cache hits are reported where there are some."""
    usage: JSON = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_tokens,
        "total_tokens": num_prompt_tokens + num_tokens,
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _sse(payload: JSON) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class DelayProxy:
    """Forwards TCP connections to `target_port`, delaying every byte by `one_way_s` in each
    direction (so a request/response exchange takes one simulated RTT longer)."""

    def __init__(self, target_port: int, one_way_s: float) -> None:
        self.target_port = target_port
        self.one_way_s = one_way_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:
                return
            try:
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
            finally:
                up_writer.close()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy bytes in order, each delivered `one_way_s` after it was read."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due_s, data = await queue.get()
                wait_s = due_s - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        delivery = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(65536)
                queue.put_nowait((time.monotonic() + self.one_way_s, data))
                if not data:
                    break
            await delivery
        finally:
            delivery.cancel()
            # The other side is gone: close this one too, like a dropped connection.
            writer.close()
