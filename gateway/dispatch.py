"""The route step of a completion: the upstream request built, the route plan made, and the first
region (or, for `auto`, the edge) that answers in time opened (gateway/proxy.py, gateway/edge.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admit import Admitted
from gateway.cache_salt import cache_salt_of
from gateway.calls import Call
from gateway.edge import AutoTier
from gateway.keys import ApiKey
from gateway.limit_shares import PopLimiter
from gateway.proxy import Opened, Proxy
from gateway.request_ids import HEADER
from gateway.routing import Router
from gateway.settings import GatewaySettings
from gateway.tiers import Tier
from gateway.upstream_request import UpstreamRequest
from wire.cache_salt import CACHE_SALT_HEADER


def upstream_headers(
    settings: GatewaySettings, key: ApiKey, request_id: str, has_body: bool
) -> dict[str, str]:
    """Built afresh: the client's headers (its API key above all) never reach a node."""
    headers = {HEADER: request_id}
    if has_body:
        headers["content-type"] = "application/json"
    authorization = settings.serving_authorization
    if authorization is not None:
        headers["authorization"] = authorization
    if not settings.share_prefix_cache:
        headers[CACHE_SALT_HEADER] = cache_salt_of(key.id)
    return headers


@dataclass(frozen=True, slots=True)
class Routed:
    upstream: UpstreamRequest  # as first sent: what a resume or a prewarm starts from
    opened: Opened
    tier: Tier


@dataclass(frozen=True, slots=True)
class Dispatch:
    settings: GatewaySettings
    router: Router
    auto: AutoTier | None  # the `auto` alias and the edge tier, when configured

    async def __call__(
        self, proxy: Proxy, limiter: PopLimiter, call: Call, admitted: Admitted, path: str
    ) -> Routed:
        """`admitted` sent to `path` upstream; when no answer is had (or the client leaves),
        its reservation is settled in full before the error goes on."""
        parsed, key = admitted.parsed, admitted.key
        try:
            plan = self.router.plan(parsed.prompt_tokens, parsed.affinity_key)
            deadline_s = call.started_s + self.settings.request_deadline_s
            upstream = UpstreamRequest(
                method="POST",
                path=path,
                body=parsed.upstream_body,
                headers=upstream_headers(self.settings, key, call.request_id, has_body=True),
                is_stream=True,  # a non-stream's answer is assembled from it
            )
            tier: Tier = "region"
            if self.auto is not None and self.auto.is_auto(parsed):
                opened, tier = await self.auto.open(proxy, upstream, parsed, key, plan, deadline_s)
            else:
                opened = await proxy.open(upstream, plan, deadline_s)
        except BaseException:
            await limiter.settle(key, admitted.admission, parsed.reserved_tokens)
            raise
        return Routed(upstream, opened, tier)
