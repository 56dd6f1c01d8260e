"""One client request as the handlers carry it (`Call`: its id, its key once known, since when),
and its record (`CallLog`): counted in the metrics, one access-log line when that is on, and a
refusal answered in OpenAI's error shape. Every answer the handlers give is recorded here once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from aiohttp import web

from gateway.errors import GatewayError, error_response
from gateway.keys import ApiKey, KeyTable
from gateway.metrics import NO_REGION, GatewayMetrics
from gateway.request_ids import HEADER, current_request_id, request_id_from
from gateway.tiers import Tier

access_logger = logging.getLogger("gateway.access")

REGION_HEADER = "x-meridian-region"
POP_HEADER = "x-meridian-pop"
TIER_HEADER = "x-meridian-tier"  # edge or region
NO_KEY = "-"


@dataclass(slots=True)
class Call:
    request: web.Request
    request_id: str
    started_s: float  # monotonic
    key: ApiKey | None = None  # once authenticated

    @classmethod
    def start(cls, request: web.Request) -> Call:
        """The call `request` begins; its id is the current request id from now on."""
        started_s = time.monotonic()
        request_id = request_id_from(request.headers.get(HEADER))
        current_request_id.set(request_id)
        return cls(request, request_id, started_s)

    def authenticate(self, keys: KeyTable) -> ApiKey:
        self.key = keys.authenticate(self.request.headers.get("authorization"))
        return self.key


@dataclass(frozen=True, slots=True)
class CallLog:
    metrics: GatewayMetrics
    pop: str
    is_access_logged: bool

    def where(self, region: str, tier: Tier) -> dict[str, str]:
        """The headers that say where a request went."""
        return {POP_HEADER: self.pop, REGION_HEADER: region, TIER_HEADER: tier}

    def refuse(self, call: Call, exc: GatewayError) -> web.Response:
        self.record(call, exc.status_code, NO_REGION, 0)
        return self.error(call, exc)

    def error(self, call: Call, exc: GatewayError) -> web.Response:
        """`exc` as the answer to `call` (recorded by the caller)."""
        return error_response(exc, {HEADER: call.request_id, POP_HEADER: self.pop})

    def record(
        self, call: Call, status: int, region: str, num_retries: int, num_tokens: int = 0
    ) -> None:
        key_id = call.key.id if call.key is not None else NO_KEY
        self.metrics.count_request(region, status, key_id)
        if self.is_access_logged:
            request = call.request
            access_logger.info(
                "%s %s %d region=%s key=%s retries=%d tokens=%d %.1fms",
                request.method,
                request.path,
                status,
                region,
                key_id,
                num_retries,
                num_tokens,
                (time.monotonic() - call.started_s) * 1000,
            )
