"""The admit step of a completion: its body read within the size cap and checked
(gateway/openai_request.py), then its rate-limit reservation taken (one request and the whole
token reservation at once, from the key's limits and its limits on the request's model, within
its token budget) or a 429 that says which limit refused it: `rate_limit_exceeded` naming the
RPM or TPM (and the model, for a limit on one), or `budget_exceeded` saying when it resets."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from aiohttp import web

from gateway.errors import BodyTooLargeError, RateLimitError
from gateway.keys import ApiKey
from gateway.limit_shares import PopLimiter, Ticket
from gateway.metrics import GatewayMetrics
from gateway.model_routes import ModelChoice
from gateway.openai_request import ParsedRequest
from wire.key_snapshot import period_text
from wire.limit_shares import split_entry


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that holds its reservation: whoever ends it settles `admission`."""

    key: ApiKey
    parsed: ParsedRequest
    admission: Ticket


async def read_body(request: web.Request, max_body_bytes: int) -> bytes:
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise BodyTooLargeError(f"request body over {max_body_bytes} bytes", "body_too_large")
    try:  # the application's client_max_size bounds bodies sent without a length
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLargeError(
            f"request body over {max_body_bytes} bytes", "body_too_large"
        ) from None


async def admit(
    limiter: PopLimiter,
    metrics: GatewayMetrics,
    key: ApiKey,
    parsed: ParsedRequest,
    choice: ModelChoice,
) -> Admitted:
    """`parsed`'s reservation for `key` on `choice`'s model (what its name resolved to), or
    RateLimitError."""
    ticket = await limiter.admit(key, choice.model, parsed.reserved_tokens, choice.limits)
    if not ticket.is_allowed:
        limited_by = ticket.admission.limited_by
        metrics.count_rate_limited(key.id, limited_by or "tokens")
        if limited_by == "budget":
            raise budget_error(key, ticket)
        raise rate_limit_error(ticket, parsed.reserved_tokens)
    return Admitted(key, parsed, ticket)


def rate_limit_error(ticket: Ticket, num_tokens: int) -> RateLimitError:
    admission = ticket.admission
    on = ""
    if ticket.refused_on_model and ticket.limits_on_model is not None:
        on = f" on model {split_entry(ticket.limits_on_model.id)[1]}"  # the name it is keyed by
    if admission.is_too_large:
        message = (
            f"Request too large for tokens per min (TPM){on}: Limit {admission.tpm}, Requested "
            f"{num_tokens} (max_tokens, and the prompt counted as at most one token per UTF-8 "
            "byte). Lower max_tokens or the prompt."
        )
    elif admission.limited_by == "requests":
        message = (
            f"Rate limit reached for requests per min (RPM){on}: Limit {admission.rpm}. Please "
            f"try again in {admission.retry_after_s:.1f}s."
        )
    else:
        message = (
            f"Rate limit reached for tokens per min (TPM){on}: Limit {admission.tpm}, Requested "
            f"{num_tokens}. Please try again in {admission.retry_after_s:.1f}s."
        )
    return RateLimitError(message, "rate_limit_exceeded", headers=admission.headers())


def budget_error(key: ApiKey, ticket: Ticket) -> RateLimitError:
    budget, admission = key.budget, ticket.admission
    assert budget is not None, "only a key with a budget is refused for it"
    resets_at = datetime.fromtimestamp(time.time() + admission.retry_after_s, UTC)
    message = (
        f"Token budget exceeded: this key's budget of {budget.max_tokens} tokens per "
        f"{period_text(budget.period_s)} is spent. It resets at "
        f"{resets_at.isoformat(timespec='seconds').replace('+00:00', 'Z')} (in "
        f"{_hours_minutes(admission.retry_after_s)})."
    )
    return RateLimitError(message, "budget_exceeded", headers=admission.headers())


def _hours_minutes(seconds: float) -> str:
    """`3h12m`, `12m5s`, `45s`."""
    whole_s = max(1, round(seconds))
    hours, rest_s = divmod(whole_s, 3600)
    minutes, rest_s = divmod(rest_s, 60)
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{rest_s}s" if minutes else f"{rest_s}s"
