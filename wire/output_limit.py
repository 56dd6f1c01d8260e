"""OpenAI's two names for a request's output limit, and the one rule every service reads them by.

`max_tokens` is the original name; chat also takes `max_completion_tokens`, its newer name. When
both are given the newer one wins, as at OpenAI: the two never conflict, so neither is refused
for the other. `null` means absent. Absent on /v1/completions means 16, OpenAI's default for
legacy completions (that endpoint knows only `max_tokens`); absent on chat is for the service to
decide (the gateway caps it, the node gives what the context leaves). The gateway writes what it
reserved back under both names (`set_output_limit`), so that the node reads the same number
whichever it looks at.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

MAX_TOKENS: Final = "max_tokens"
MAX_COMPLETION_TOKENS: Final = "max_completion_tokens"
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16


def chat_output_limit(read: Callable[[str], int | None]) -> int | None:
    """A chat request's output limit, `read(name)` giving the value under a name (None: absent);
    None when neither is given. The older name is read only when the newer is absent: a reader
    that validates as it reads judges only the name that counts."""
    newer = read(MAX_COMPLETION_TOKENS)
    return newer if newer is not None else read(MAX_TOKENS)


def completions_output_limit(max_tokens: int | None) -> int:
    """A /v1/completions request's output limit."""
    return COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens


def set_output_limit(body: dict[str, object], max_tokens: int) -> None:
    """Write `max_tokens` into a request body as its output limit: under `max_tokens`, and under
    `max_completion_tokens` too where the body has that name (any reader then sees the same)."""
    body[MAX_TOKENS] = max_tokens
    if MAX_COMPLETION_TOKENS in body:
        body[MAX_COMPLETION_TOKENS] = max_tokens
