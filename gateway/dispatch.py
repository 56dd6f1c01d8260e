"""The route step of a completion: the upstream request built, the route plan made, and the first
region (or, for `auto`, the edge) that answers in time opened (gateway/proxy.py, gateway/edge.py).

The request goes as the model it resolved to (gateway/model_routes.py): its plan is among the
regions serving that model, and the body and MODEL_HEADER name it. After the first region, the
plan keeps only the regions whose nodes for the model report the same weights (a model's name
answers with one text, failover or not). When the model has no capacity reachable (no region
serving it can take work: none serves it, or every one is circuit-open or saturated; every
region tried refused for capacity, or none could be reached), the next of its fallbacks the key
may use is tried the same way, within the same deadline; the answer is the first model's with
capacity, or the last refusal. A model whose regions are all circuit-open or saturated is tried
after its fallbacks rather than not at all (`in_turn`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.admit import Admitted
from gateway.cache_salt import cache_salt_of
from gateway.calls import Call
from gateway.edge import AutoTier
from gateway.errors import GatewayError, NoCapacityError, UpstreamError
from gateway.keys import ApiKey
from gateway.limit_shares import PopLimiter
from gateway.model_routes import ModelChoice, in_turn, is_out_of_capacity
from gateway.plan_checks import among_same_weights, has_capacity
from gateway.proxy import Opened, Proxy
from gateway.request_ids import HEADER
from gateway.routing import RoutePlan, Router
from gateway.settings import GatewaySettings
from gateway.tiers import Tier
from gateway.upstream_request import UpstreamRequest
from wire.cache_salt import CACHE_SALT_HEADER
from wire.prefix_key import PREFIX_KEY_HEADER

logger = logging.getLogger(__name__)


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
    model: str  # the model that answered: its name went upstream
    is_model_aware: bool  # False: planned over every region (a version 1 document)


@dataclass(frozen=True, slots=True)
class Dispatch:
    settings: GatewaySettings
    router: Router
    auto: AutoTier | None  # the `auto` alias and the edge tier, when configured

    async def __call__(
        self,
        proxy: Proxy,
        limiter: PopLimiter,
        call: Call,
        admitted: Admitted,
        path: str,
        choice: ModelChoice,
    ) -> Routed:
        """`admitted` sent to `path` upstream as `choice`'s first model with capacity; when no
        answer is had (or the client leaves), its reservation is settled in full before the
        error goes on."""
        parsed, key = admitted.parsed, admitted.key
        try:
            headers = upstream_headers(self.settings, key, call.request_id, has_body=True)
            if parsed.affinity_key is not None:  # what the nodes report their hot prefixes by
                headers[PREFIX_KEY_HEADER] = parsed.affinity_key
            upstream = UpstreamRequest(
                method="POST",
                path=path,
                body=parsed.upstream_body,
                headers=headers,
                is_stream=True,  # a non-stream's answer is assembled from it
            )
            deadline_s = call.started_s + self.settings.request_deadline_s
            return await self._open(proxy, upstream, admitted, choice, deadline_s)
        except BaseException:
            await limiter.settle(key, admitted.admission, parsed.reserved_tokens)
            raise

    async def _open(
        self,
        proxy: Proxy,
        upstream: UpstreamRequest,
        admitted: Admitted,
        choice: ModelChoice,
        deadline_s: float,
    ) -> Routed:
        """The answer of the first of `choice`'s models with capacity reachable: a region
        planned for it that answers other than with a refusal for capacity. When none has,
        the last refusal, else why no region could answer."""
        parsed = admitted.parsed
        refusal: Routed | None = None
        error: GatewayError | None = None
        # `auto`'s own model may still go to the edge when no region can take it.
        is_auto_asked = self.auto is not None and self.auto.is_auto(parsed)

        def plan_of(model: str) -> RoutePlan:
            plan_model = model if choice.is_model_aware else None
            return self.router.plan(
                parsed.prompt_tokens,
                parsed.affinity_key,
                model=plan_model,
                prefix_tokens=parsed.prefix_tokens,
            )

        def may_open(model: str, plan: RoutePlan) -> bool:
            return has_capacity(plan) or (is_auto_asked and model == choice.model)

        turns = in_turn(choice.models, plan_of, may_open)
        for turn, (model, plan) in enumerate(turns, start=1):
            is_auto = is_auto_asked and model == choice.model
            if not plan.candidates and not is_auto:
                continue
            plan_model = model if choice.is_model_aware else None
            if plan_model is not None:
                plan = among_same_weights(plan, self.router.regions, plan_model)
            request = upstream.for_model(model) if choice.is_model_aware else upstream
            try:
                is_last = turn == len(choice.models)
                opened, tier = await self._open_plan(
                    proxy, request, admitted, plan, deadline_s, is_auto, plan_model, is_last
                )
            except (UpstreamError, NoCapacityError) as exc:  # none reachable, or none planned
                error = exc
                continue
            answered_by = model  # the edge serves `auto` only as the model it resolved to
            if tier == "edge" and self.auto is not None and not choice.is_model_aware:
                answered_by = self.auto.edge_model  # model-blind: the edge's, as configured
            routed = Routed(request, opened, tier, answered_by, choice.is_model_aware)
            if not is_out_of_capacity(opened.status):
                if model != choice.model:
                    logger.info("model %s has no capacity: %s answered", choice.model, model)
                return routed
            if refusal is not None:
                refusal.opened.finish()
            refusal = routed
        if refusal is not None:
            return refusal
        raise error or _no_capacity(choice)

    async def _open_plan(
        self,
        proxy: Proxy,
        request: UpstreamRequest,
        admitted: Admitted,
        plan: RoutePlan,
        deadline_s: float,
        is_auto: bool,
        model: str | None,
        is_last: bool,
    ) -> tuple[Opened, Tier]:
        """`is_auto`: `auto`'s own model (its fallbacks go to the regions as any model);
        `model`: what it resolved to (None: model-blind); `is_last`: no model after it."""
        if is_auto and self.auto is not None:
            parsed, key = admitted.parsed, admitted.key
            return await self.auto.open(proxy, request, parsed, key, plan, deadline_s, model)
        return await proxy.open(request, plan, deadline_s, is_last), "region"


def _no_capacity(choice: ModelChoice) -> NoCapacityError:
    if not choice.is_model_aware:
        message = "no region can take requests now"
    elif len(choice.models) == 1:
        message = f"no region can take requests for the model {choice.model!r} now"
    else:
        tried = ", ".join(repr(model) for model in choice.models)
        message = f"no region can take requests for the models {tried} now"
    return NoCapacityError(message, "no_capacity", headers={"retry-after": "1"})
