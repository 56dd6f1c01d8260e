"""bench.endpoint_picker's workload against a stand-in gateway on loopback (real HTTP, server-sent
events with usage): each arrival order sends every tenant's chats once, and the cache share is
counted against the ideal (every chat's prefix cached after its tenant's first)."""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
from pathlib import Path

import pytest
from aiohttp import web

from bench.endpoint_picker import Stack, Tenant, interleaved_order, workload
from stack.state import ProcessRecord, StackState

PREFIX_TOKENS = 32


class StandIn:
    """Answers a chat with one token; its prompt's prefix counts as cached once its tenant (the
    system prompt) was seen, so the ideal is exactly what comes back."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []  # (system, question), in arrival order

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        system, question = (m["content"] for m in body["messages"])
        cached = PREFIX_TOKENS if any(s == system for s, _ in self.seen) else 0
        self.seen.append((system, question))
        await asyncio.sleep(0.001 * (len(self.seen) % 3))  # answers end out of order
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        usage = {
            "prompt_tokens": 40,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        for chunk in ({"choices": [{"delta": {"content": "hi"}}]}, {"choices": [], "usage": usage}):
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        return reply


def stand_in_stack(url: str) -> Stack:
    record = ProcessRecord("picker us-east", "picker", 0, "", "", None)
    state = StackState(supervisor=record, config="", gateway_url=url)
    return Stack(Path("/nonexistent"), state, {}, ssl.create_default_context(), record, [], "")


@pytest.mark.parametrize("arrival", ["per-tenant", "interleaved"])
def test_every_chat_is_sent_once_and_counted_against_the_ideal(arrival: str) -> None:
    tenants = [Tenant(f"system of tenant {t}", PREFIX_TOKENS) for t in range(4)]
    args = argparse.Namespace(requests_per_tenant=3, max_tokens=4, stagger_s=0.0, arrival=arrival)
    stand_in = StandIn()

    async def main() -> dict[str, object]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", stand_in.chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            stack = stand_in_stack(f"http://127.0.0.1:{port}")
            return await workload(stack, arrival, ["key"] * 4, tenants, args)
        finally:
            await runner.cleanup()

    summary = asyncio.run(main())
    assert len(stand_in.seen) == len(set(stand_in.seen)) == 12
    for t, tenant in enumerate(tenants):
        asked = sorted(q.split(":")[0] for s, q in stand_in.seen if s == tenant.system)
        assert asked == [f"Request {j} of tenant {t}" for j in range(3)]
    assert (summary["requests"], summary["failed"]) == (12, 0)
    assert summary["ideal_cached_tokens"] == summary["cached_tokens"] == 4 * 2 * PREFIX_TOKENS
    assert summary["cache_share_of_ideal"] == 1.0


def test_interleaved_rounds_hold_every_tenant_once_in_a_seeded_order() -> None:
    order = interleaved_order(4, 3)
    assert order == interleaved_order(4, 3) and order != interleaved_order(4, 3, seed=1)
    rounds = [order[i : i + 4] for i in range(0, 12, 4)]
    assert all(sorted(t for t, _ in r) == [0, 1, 2, 3] for r in rounds)
    assert [{j for _, j in r} for r in rounds] == [{0}, {1}, {2}]
