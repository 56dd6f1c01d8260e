"""Continuing a broken stream in another region: the continuation request, and the decision.

The continuation is the request as first sent upstream plus `resume_token_ids` (the output ids
relayed so far; a client may not send that field itself, gateway/openai_request.py) and a
`max_tokens` reduced by them (wire/resume.py). It goes to the regions the request has not tried
yet, in the order of a plan made among them at the break: by then the breaker has heard of the
streams broken before it, and those moved count as this gateway's requests awaiting a first
byte, so a region's many broken streams spread instead of all following the first plan's second
choice; for a model, only the regions whose nodes serve the very weights the stream began on
(`ResumeTargets`). The node then produces what an unbroken run would have produced next: the
same text for greedy decoding, and for seeded sampling where the engine's sampling is
deterministic (docs/gateway.md). Every resume feeds the broken region's circuit breaker and the
resume metrics; a resume that cannot happen (no region left, the deadline passed, the resume
budget spent, the continuation refused, a request of several choices, whose interleaved ids
no one continuation could carry) lets the stream end with its error event.

A continuation carries every field of the request as first sent, so a constrained one
(`response_format`, `guided_*`, a required or named `tool_choice`) goes on under the same
grammar: the node advances its matcher over the resumed ids before it samples, and, with tools,
parses their text without sending it again (node_agent/chat_choices.py), so a tool call's
argument deltas go on where they broke off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from functools import partial

from gateway.dispatch import Routed
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.openai_request import ParsedRequest
from gateway.proxy import Opened, Proxy
from gateway.routing import Candidate, Router
from gateway.sse import StreamReader
from gateway.upstream_request import UpstreamRequest
from wire.resume import RESUME_TOKEN_IDS

logger = logging.getLogger(__name__)


def continuation_of(request: UpstreamRequest, token_ids: list[int]) -> UpstreamRequest | None:
    """The request that continues `request` after the output `token_ids`; None when nothing is
    left to generate."""
    num_left = request.max_tokens - len(token_ids)
    if num_left < 1 or request.body is None:
        return None
    # No ids: it broke before any output, and the continuation starts afresh.
    changes = {RESUME_TOKEN_IDS: token_ids} if token_ids else {}
    return replace(request, body=request.body.edited(changes, max_tokens=num_left))


def _num_choices(request: UpstreamRequest) -> int:
    n = request.body.fields.get("n") if request.body is not None else None
    return n if isinstance(n, int) else 1


@dataclass(frozen=True, slots=True)
class ResumeTargets:
    """Where one stream may continue: the router's plan among the regions not tried yet and,
    for a model, among those whose nodes for it write exactly what the stream's first region's
    did (`serving_key`): a continuation on other weights would be another text."""

    router: Router
    affinity_key: str | None
    model: str | None  # the model planned for (None: model-blind, any region)
    serving_key: str | None  # the first region's nodes' for `model` (None: not one known)
    prefix_tokens: int  # the request's system prompt's part of its prompt (0: none)

    @classmethod
    def of(cls, router: Router, parsed: ParsedRequest, routed: Routed) -> ResumeTargets:
        key, prefix_tokens = parsed.affinity_key, parsed.prefix_tokens
        if not routed.is_model_aware:
            return cls(router, key, None, None, prefix_tokens)
        region = routed.opened.candidate.region
        serving_key = router.serving_key_of(region, routed.model)
        return cls(router, key, routed.model, serving_key, prefix_tokens)

    def candidates(self, prompt_tokens: int, tried: Collection[str]) -> list[Candidate]:
        plan = self.router.plan(
            prompt_tokens,
            self.affinity_key,
            exclude=tried,
            model=self.model,
            prefix_tokens=self.prefix_tokens,
        )
        model = self.model
        if model is None:
            return plan.candidates
        if self.serving_key is None:
            return []
        key_of = self.router.serving_key_of
        return [c for c in plan.candidates if key_of(c.region, model) == self.serving_key]


@dataclass(slots=True)
class Resumer:
    """Opens continuations of one request's stream (the relay's `resume`)."""

    proxy: Proxy
    metrics: GatewayMetrics
    request: UpstreamRequest
    prompt_tokens: int  # the request's, for the plan at a break
    targets: ResumeTargets

    async def __call__(self, broken: Opened, reader: StreamReader, cause: str) -> Opened | None:
        attempts = broken.attempts
        if attempts is None:
            return None
        if _num_choices(self.request) > 1:
            self.metrics.count_resume_refused("multiple_choices")
            return None
        prompt_tokens = self.prompt_tokens + len(reader.token_ids)  # the continuation's
        refusal = attempts.resume(time.monotonic(), partial(self.targets.candidates, prompt_tokens))
        if refusal is not None:
            self.metrics.count_resume_refused(refusal.reason)
            return None
        continuation = continuation_of(self.request, reader.token_ids)
        if continuation is None:
            self.metrics.count_resume_refused("nothing_left")
            return None
        try:
            opened = await self.proxy.resume(continuation, attempts)
        except GatewayError as exc:
            self.metrics.count_resume_refused(exc.code)
            return None
        if opened.status != 200:
            opened.finish()
            logger.warning("resume refused by %s: HTTP %d", opened.candidate.region, opened.status)
            self.metrics.count_resume_refused(f"http_{opened.status}")
            return None
        # The broken region's failure (when no resume happens, the stream's end records it).
        region = broken.candidate.region
        state = self.targets.router.state_of(region)
        if state is not None:
            state.breaker.on_failure(time.monotonic())
        self.metrics.count_resume(region, opened.candidate.region)
        logger.warning("stream resumed from %s in %s (%s)", region, opened.candidate.region, cause)
        return opened
