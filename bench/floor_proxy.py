"""The least a Python proxy does, for `bench/gateway_overhead.py`: what aiohttp on uvloop costs
before any of the gateway's work (keys, limits, routing, metrics, the access log, resumes).

    python -m bench.floor_proxy --port 9200 --upstream http://127.0.0.1:9100 [--collect]

Every `POST /v1/chat/completions` goes to the upstream on a pooled connection: streams are
relayed chunk by chunk as they arrive; a non-streamed request is forwarded as it came, or with
`--collect` asked for as a stream (with usage) and answered whole from its events, which is
what the gateway does so that it can resume a non-streamed answer whose node dies.
"""

from __future__ import annotations

import argparse
import json

import aiohttp
from aiohttp import web

from bench.gateway_upstream import serve

Json = dict[str, object]
JSON_HEADERS = {"Content-Type": "application/json"}


def whole_from_events(events: list[Json]) -> Json:
    """A chat completion from the chunks of its stream (one choice, as the benchmark asks)."""
    content: list[str] = []
    finish_reason = None
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:  # type: ignore[attr-defined]
            content.append(choice["delta"].get("content") or "")
            finish_reason = choice.get("finish_reason") or finish_reason
    message = {"role": "assistant", "content": "".join(content)}
    first = events[0] if events else {}
    return {
        "id": first.get("id"),
        "object": "chat.completion",
        "model": first.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": usage,
    }


async def stream_events(response: aiohttp.ClientResponse) -> list[Json]:
    """The JSON payloads of an SSE stream's `data:` events, up to `[DONE]`."""
    events: list[Json] = []
    pending = b""
    async for chunk in response.content.iter_any():
        *complete, pending = (pending + chunk).split(b"\n\n")
        for event in complete:
            if event.startswith(b"data: {"):
                events.append(json.loads(event[6:]))
    return events


def make_app(upstream: str, collect: bool) -> web.Application:
    url = upstream.rstrip("/") + "/v1/chat/completions"
    sessions: list[aiohttp.ClientSession] = []

    async def open_session(app: web.Application) -> None:
        sessions.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))

    async def close_session(app: web.Application) -> None:
        await sessions[0].close()

    async def complete(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        streamed = bool(body.get("stream"))
        if collect and not streamed:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            raw = json.dumps(body).encode()
        async with sessions[0].post(url, data=raw, headers=JSON_HEADERS) as upstream_answer:
            if not streamed:
                if collect and upstream_answer.status == 200:
                    whole = whole_from_events(await stream_events(upstream_answer))
                    return web.json_response(whole)
                answer = await upstream_answer.read()
                return web.Response(
                    body=answer, status=upstream_answer.status, headers=JSON_HEADERS
                )
            relayed = web.StreamResponse(status=upstream_answer.status)
            relayed.content_type = upstream_answer.content_type
            await relayed.prepare(request)
            async for chunk in upstream_answer.content.iter_any():
                await relayed.write(chunk)
            await relayed.write_eof()
            return relayed

    app = web.Application()
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/v1/chat/completions", complete)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_proxy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's base URL")
    parser.add_argument(
        "--collect", action="store_true", help="answer non-streamed requests from a stream"
    )
    args = parser.parse_args()
    serve(make_app(args.upstream, args.collect), args.host, args.port)


if __name__ == "__main__":
    main()
