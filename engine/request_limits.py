"""The check at the engine's front: what a request must respect to run, fixed once the engine
has started.

Each entry point calls `RequestLimits.check` once for a request, before queueing it: the offline
engine (`LLMEngine.add_request`) and the serving API's front (`AsyncEngine.generate`); the engine
core behind them takes requests as checked. A server that must answer before its response
starts checks first with its own rule (node_agent/serving.py), so its requests pass two. Kept
apart from the engine so that a server in another process than the engine core can refuse a
bad request before sending it anywhere (engine/core_client.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import RequestRejected
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int  # tokens: prompt, resumed output and new output together
    vocab_size: int

    def check(
        self,
        token_ids: Sequence[int],
        params: SamplingParams,
        resumed_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        *,
        clamp_max_tokens: bool = True,
    ) -> None:
        """Raise RequestRejected, naming the argument at fault, if this request cannot run.

        With `clamp_max_tokens` (the engine's own rule), `params.max_tokens` is a cap that the
        context may cut short; without it (OpenAI's rule), the prompt and `max_tokens` together
        must fit in the context."""
        if cache_salt is not None and not cache_salt:
            raise RequestRejected("cache_salt", "cache_salt must be a non-empty string if given")
        if not token_ids:
            raise RequestRejected("prompt", "the prompt is empty")
        resumed = resumed_token_ids or ()
        max_tokens = None if clamp_max_tokens else params.max_tokens
        self.check_fits(len(token_ids) + len(resumed), max_tokens)
        vocab_size = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise RequestRejected("prompt", f"prompt token ids must be in [0, {vocab_size})")
        if resumed and (min(resumed) < 0 or max(resumed) >= vocab_size):
            raise RequestRejected(
                "resumed_token_ids", f"resumed token ids must be in [0, {vocab_size})"
            )
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise RequestRejected("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size})")
        if any(t >= vocab_size for t in params.logit_bias):
            raise RequestRejected("logit_bias", f"logit_bias ids must be in [0, {vocab_size})")
        if params.grammar is not None:
            params.grammar.check()

    def check_fits(
        self, num_prompt_tokens: int, max_tokens: int | None, is_at_least: bool = False
    ) -> None:
        """The context-length part of `check`, on a count: the prompt (resumed output included)
        must leave at least one token to generate, and room for `max_tokens` if given.
        `is_at_least`: `num_prompt_tokens` is a lower bound, not a count (a server's estimate
        before it encodes a prompt)."""
        limit = self.max_model_len
        at_least = "at least " if is_at_least else ""
        if num_prompt_tokens >= limit:
            raise RequestRejected(
                "prompt",
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {at_least}{num_prompt_tokens} tokens, and at least one must be left to "
                "generate.",
                exceeds_context=True,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise RequestRejected(
                "max_tokens",
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{at_least}{num_prompt_tokens + max_tokens} tokens ({at_least}"
                f"{num_prompt_tokens} in the prompt, {max_tokens} for the completion). Please "
                "reduce the prompt or max_tokens.",
                exceeds_context=True,
            )
