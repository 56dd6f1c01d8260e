"""bench.floor_proxy, the least a Python proxy does, in front of the benchmark's own upstream:
it forwards as it came, relays streams whole, and with `--collect` answers a non-streamed
request from the upstream's stream with the same content and usage the stream carried."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from bench import floor_proxy, gateway_upstream

CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

Send = Callable[[dict[str, object]], Awaitable[tuple[int, bytes]]]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def _through_proxy(collect: bool, requests: list[dict[str, object]]) -> list[tuple[int, bytes]]:
    async def run() -> list[tuple[int, bytes]]:
        upstream, upstream_url = await _serve(gateway_upstream.make_app())
        proxy, proxy_url = await _serve(floor_proxy.make_app(upstream_url, collect))
        try:
            async with aiohttp.ClientSession() as session:
                answers = []
                for body in requests:
                    url = proxy_url + "/v1/chat/completions"
                    async with session.post(url, json=body) as response:
                        answers.append((response.status, await response.read()))
                return answers
        finally:
            await proxy.cleanup()
            await upstream.cleanup()

    return asyncio.run(run())


def test_a_non_streamed_request_is_forwarded_as_it_came() -> None:
    [(status, body)] = _through_proxy(False, [CHAT])
    assert status == 200 and body == gateway_upstream.WHOLE


@pytest.mark.parametrize("collect", [False, True])
def test_a_stream_is_relayed_to_its_end(collect: bool) -> None:
    [(status, body)] = _through_proxy(collect, [CHAT | {"stream": True}])
    assert status == 200
    assert body.count(b"data: {") == 4 + 2 and body.endswith(b"data: [DONE]\n\n")


def test_collect_answers_whole_from_the_stream_it_asked_for() -> None:
    [(status, body)] = _through_proxy(True, [CHAT])
    whole = json.loads(body)
    assert status == 200 and whole["object"] == "chat.completion"
    [choice] = whole["choices"]
    assert choice["message"] == {"role": "assistant", "content": "t0 t1 t2 t3 "}
    assert choice["finish_reason"] == "stop"
    assert whole["usage"] == {"prompt_tokens": 8, "completion_tokens": 4}
