"""Warming the region a stream would resume in: its prompt sent there once, at the stream's start.

A continuation is prefilled in full where it resumes: the prompt and every token relayed so far
(gateway/resume.py). With `resume_prewarm` on, the gateway also sends each stream's request, cut
to one output token and not streamed, to the region a resume would go to now (the router's plan
without the stream's own region), as soon as the stream's first chunk is in. That region's
prefix cache then holds the prompt's whole blocks (per tenant: the same cache-salt header), and a
continuation there prefills only the rest: the resume's gap shrinks by the prompt's prefill, for
the price of prefilling every stream's prompt twice. Off by default (a gateway-wide setting):
for a fleet whose streams must survive a region with the shortest gap. Nothing waits on it and
its answer is dropped: a failure only costs the warm cache (counted in
`meridian_gateway_resume_prewarms_total{region, outcome}`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy
from gateway.request_ids import HEADER as REQUEST_ID_HEADER
from gateway.resume import ResumeTargets
from gateway.upstream_request import UpstreamRequest

logger = logging.getLogger(__name__)


def prewarm_of(request: UpstreamRequest) -> UpstreamRequest | None:
    """`request` cut to one output token, whole rather than streamed, its request id marked as
    a prewarm's (None: it has no body)."""
    if request.body is None:
        return None
    body = request.body.edited({"stream": False}, removed=("stream_options",), max_tokens=1)
    headers = dict(request.headers)
    if REQUEST_ID_HEADER in headers:
        headers[REQUEST_ID_HEADER] += "-prewarm"
    return replace(request, body=body, headers=headers, is_stream=False)


async def prewarm(
    proxy: Proxy,
    metrics: GatewayMetrics,
    request: UpstreamRequest,
    home: str,
    prompt_tokens: int,
    targets: ResumeTargets,
) -> None:
    """Send `request`'s prewarm to the region a stream from `home` would resume in now."""
    warm = prewarm_of(request)
    if warm is None:
        return
    candidates = targets.candidates(prompt_tokens, (home,))
    if not candidates:
        return
    region = candidates[0].region
    outcome = await proxy.send_aside(warm, candidates[0])
    metrics.count_prewarm(region, outcome)
    if outcome != "ok":
        logger.info("prewarm of %s failed: %s", region, outcome)
