"""What a request must respect to run: fixed once the engine has started.

Kept apart from the engine so that a server in another process than the engine core can refuse a
bad request before sending it anywhere (engine/core_client.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams


def check_cache_salt(cache_salt: str | None) -> None:
    if cache_salt is not None and not cache_salt:
        raise InvalidRequestError("cache_salt must be a non-empty string if given")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int  # tokens: prompt, resumed output and new output together
    vocab_size: int

    def check(
        self,
        token_ids: list[int],
        params: SamplingParams,
        resumed_token_ids: list[int] | None = None,
    ) -> None:
        """Raise InvalidRequestError if this prompt cannot run."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        resumed = resumed_token_ids or []
        num_tokens = len(token_ids) + len(resumed)
        if num_tokens >= self.max_model_len:
            what = "the prompt and resumed output have" if resumed else "the prompt has"
            raise InvalidRequestError(
                f"{what} {num_tokens} tokens, but this model's context is "
                f"{self.max_model_len} tokens, and at least one must be left to generate"
            )
        vocab_size = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
        if resumed and (min(resumed) < 0 or max(resumed) >= vocab_size):
            raise InvalidRequestError(f"resumed token ids must be in [0, {vocab_size})")
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})")
