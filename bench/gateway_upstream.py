"""A fast OpenAI-shaped upstream for `bench/gateway_overhead.py`: no model, canned answers.

    python -m bench.gateway_upstream --port 9100

`POST /v1/chat/completions` answers a small chat completion (with usage) at once, or, with
`"stream": true`, an SSE stream: the role chunk at once, then `max_tokens` content chunks (16 if
not given, at most 4096), the usage chunk if asked for, and `[DONE]`. The content chunks go
`"bench_chunk_interval_ms"` apart when the body carries it (a paced stream, like a model's),
else at once: the gateway asks for a non-streamed completion as a stream (to resume it if it
breaks), and that internal stream must cost only what the gateway adds. aiohttp on uvloop, one
process, so it costs as little CPU as we can make it.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvloop
from aiohttp import web

Json = dict[str, object]


def _sse(payload: Json) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


USAGE = {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}
WHOLE = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "one two three four"},
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]}).encode()


DEFAULT_CHUNKS = 16
PACE_FIELD = "bench_chunk_interval_ms"
MAX_CHUNKS = 4096


def make_app() -> web.Application:
    base: Json = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "model": "bench"}

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=WHOLE, content_type="application/json")
        num_chunks = min(int(body.get("max_tokens") or DEFAULT_CHUNKS), MAX_CHUNKS)
        chunk_interval_s = float(body.get(PACE_FIELD) or 0.0) / 1000.0
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        extra: Json = {"usage": None} if include_usage else {}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        await response.write(_sse({**base, "choices": [role], **extra}))
        for i in range(num_chunks):
            if chunk_interval_s:
                await asyncio.sleep(chunk_interval_s)
            choice = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
            await response.write(_sse({**base, "choices": [choice], **extra}))
        final = {"index": 0, "delta": {}, "finish_reason": "stop"}
        await response.write(_sse({**base, "choices": [final], **extra}))
        if include_usage:
            usage = {"prompt_tokens": 8, "completion_tokens": num_chunks}
            await response.write(_sse({**base, "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=MODELS, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    args = parser.parse_args()
    serve(make_app(), args.host, args.port)


def serve(app: web.Application, host: str, port: int) -> None:
    """`app` on uvloop until stopped: no access log, a deep accept queue (the benchmark's
    hundreds of streams open at once)."""
    web.run_app(
        app,
        host=host,
        port=port,
        access_log=None,
        print=None,
        backlog=4096,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
