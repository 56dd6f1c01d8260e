"""The continuation request: the first request's body, the ids relayed, max_tokens less them; and
where it goes."""

from __future__ import annotations

import asyncio
import json
import random
import time
from types import SimpleNamespace
from typing import Any

from test_gw_routing import CONFIG as ROUTER_CONFIG
from test_gw_routing import summary as region_summary

from gateway.attempts import AttemptLimits, AttemptSequence, Try
from gateway.errors import UpstreamError
from gateway.metrics import GatewayMetrics
from gateway.resume import Resumer, ResumeTargets, continuation_of
from gateway.routing import Router
from gateway.sse import StreamReader
from gateway.upstream_request import UpstreamBody, UpstreamRequest
from wire.geo import locate
from wire.region_summary import RegionSummaryIndex
from wire.routing_policy import RoutingPolicy


def request(body: dict[str, object], max_tokens: int) -> UpstreamRequest:
    return UpstreamRequest(
        "POST", "/v1/chat/completions", UpstreamBody.of(body, max_tokens), {}, True
    )


def test_the_continuation_resumes_after_the_relayed_ids_with_fewer_tokens_left() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hé"}],
        "seed": 3,
        "max_tokens": 10,
        "max_completion_tokens": 10,
    }
    continuation = continuation_of(request(body, 10), [5, 6, 7])
    assert continuation is not None and continuation.max_tokens == 7
    assert continuation.body is not None
    sent = json.loads(continuation.body.encoded)
    assert sent == {
        **body,
        "max_tokens": 7,
        "max_completion_tokens": 7,
        "resume_token_ids": [5, 6, 7],
    }


def test_nothing_to_continue_when_every_token_was_relayed() -> None:
    assert continuation_of(request({"model": "m", "max_tokens": 2}, 2), [5, 6]) is None


def test_a_stream_broken_before_any_output_starts_afresh() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    continuation = continuation_of(request(body, 4), [])
    assert continuation is not None and continuation.body is not None
    assert json.loads(continuation.body.encoded) == body


def test_a_resume_goes_where_the_router_would_send_the_continuation_at_the_break() -> None:
    """The first plan's order is stale by the time a region breaks: the streams it moved
    before wait for their first byte in its second choice, which the plan at the break sees."""
    router = Router(ROUTER_CONFIG, locate("new-york"), rng=random.Random(1))
    regions = [region_summary(name) for name in ("us-east", "toronto", "chicago")]
    router.update(RegionSummaryIndex(index=1, regions=regions, routing=RoutingPolicy()))
    first = router.plan(400).candidates  # all three near-best: prefill outweighs distance
    attempts = AttemptSequence(first, AttemptLimits(3, 1), deadline_s=time.monotonic() + 60.0)
    broken_region = attempts.next(time.monotonic())
    assert isinstance(broken_region, Try)
    stale_choice = first[1].region
    router.regions[stale_choice].num_awaiting_first_byte = 3  # a herd moved there already
    tried: list[str] = []

    class Proxy:
        async def resume(self, continuation: UpstreamRequest, seq: AttemptSequence) -> None:
            step = seq.next(time.monotonic())
            assert isinstance(step, Try)
            tried.append(step.candidate.region)
            raise UpstreamError("stop here", "upstream_unreachable")

    body = {"model": "m", "max_tokens": 10}
    proxy: Any = Proxy()
    targets = ResumeTargets(router, None, None, None, 0)
    resumer = Resumer(proxy, GatewayMetrics("test"), request(body, 10), 400, targets)
    reader = StreamReader(strip_usage=False)
    reader.token_ids.extend([5, 6])
    broken: Any = SimpleNamespace(attempts=attempts, candidate=broken_region.candidate)
    assert asyncio.run(resumer(broken, reader, "connection lost")) is None
    assert tried and tried[0] not in (broken_region.candidate.region, stale_choice)
