"""The admit step of a completion: its body read within the size cap and checked
(gateway/openai_request.py), then its rate-limit reservation taken (one request and the whole
token reservation at once) or a 429 that says which limit refused it."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gateway.errors import BodyTooLargeError, RateLimitError
from gateway.keys import ApiKey
from gateway.limit_shares import PopLimiter
from gateway.limits import Admission
from gateway.metrics import GatewayMetrics
from gateway.openai_request import ParsedRequest


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that holds its reservation: whoever ends it settles `admission`."""

    key: ApiKey
    parsed: ParsedRequest
    admission: Admission


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
    limiter: PopLimiter, metrics: GatewayMetrics, key: ApiKey, parsed: ParsedRequest
) -> Admitted:
    """`parsed`'s reservation for `key`, or RateLimitError."""
    admission = await limiter.admit(key, parsed.reserved_tokens)
    if not admission.is_allowed:
        metrics.count_rate_limited(key.id, admission.limited_by or "tokens")
        raise rate_limit_error(admission, parsed.reserved_tokens)
    return Admitted(key, parsed, admission)


def rate_limit_error(admission: Admission, num_tokens: int) -> RateLimitError:
    if admission.is_too_large:
        message = (
            f"Request too large for tokens per min (TPM): Limit {admission.tpm}, Requested "
            f"{num_tokens} (max_tokens, and the prompt counted as at most one token per UTF-8 "
            "byte). Lower max_tokens or the prompt."
        )
    elif admission.limited_by == "requests":
        message = (
            f"Rate limit reached for requests per min (RPM): Limit {admission.rpm}. Please try "
            f"again in {admission.retry_after_s:.1f}s."
        )
    else:
        message = (
            f"Rate limit reached for tokens per min (TPM): Limit {admission.tpm}, Requested "
            f"{num_tokens}. Please try again in {admission.retry_after_s:.1f}s."
        )
    return RateLimitError(message, "rate_limit_exceeded", headers=admission.headers())
