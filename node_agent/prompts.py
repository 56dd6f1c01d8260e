"""A request's prompt as token ids, made off the event loop, and the context-length rule.

The event loop sends heartbeats and answers probes, so the chat template renders and the
tokenizer encodes in a worker thread (the engine's tokenizer releases the GIL while it encodes:
seconds for a few megabytes). Before encoding, a cheap bound: no token stands for more than the
tokenizer's `max_bytes_per_token` bytes of text, so text of B UTF-8 bytes is at least
ceil(B / that) tokens; when those alone leave no room in the context, the prompt is refused
unencoded. A byte count can only prove a prompt too long, never short enough (a token usually
covers several bytes), so every prompt that passes is encoded and checked exactly.

Resumed output ids (wire/resume.py) take room in the context like the prompt: every check here
counts them in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from engine.chat_template import ChatMessage
from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.tokenizer import Tokenizer
from node_agent.errors import BadRequestError, ContextLengthExceededError


@dataclass(frozen=True, slots=True)
class ContextWindow:
    """Prompt, resumed output and `max_tokens` must fit in `max_model_len`, with at least one
    token left to generate."""

    max_model_len: int

    def check(
        self, num_prompt_tokens: int, max_tokens: int | None, param: str, is_at_least: bool = False
    ) -> None:
        """ContextLengthExceededError (400) unless it fits; `is_at_least`: `num_prompt_tokens`
        is a lower bound, not a count."""
        limit = self.max_model_len
        at_least = "at least " if is_at_least else ""
        if num_prompt_tokens >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {at_least}{num_prompt_tokens} tokens, and at least one must be left to "
                "generate.",
                param=param,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{at_least}{num_prompt_tokens + max_tokens} tokens ({at_least}"
                f"{num_prompt_tokens} in the prompt, {max_tokens} for the completion). Please "
                "reduce the prompt or max_tokens.",
                param="max_tokens",
            )


@dataclass(frozen=True, slots=True)
class PromptEncoder:
    tokenizer: Tokenizer
    window: ContextWindow

    async def encode_chat(
        self, messages: Sequence[ChatMessage], num_resumed: int, max_tokens: int | None
    ) -> list[int]:
        """The chat's prompt ids (template rendered, generation prompt added), or a 400."""
        return await asyncio.to_thread(self._encode_chat, messages, num_resumed, max_tokens)

    async def encode_text(self, text: str, num_resumed: int, max_tokens: int | None) -> list[int]:
        """The prompt text's ids, or a 400."""
        return await asyncio.to_thread(self._encode, text, num_resumed, max_tokens, "prompt")

    def check(
        self, token_ids: list[int], num_resumed: int, max_tokens: int | None, param: str
    ) -> None:
        """A prompt given as ids (or just encoded) against the context, resumed ids included."""
        self.window.check(len(token_ids) + num_resumed, max_tokens, param)

    def _encode_chat(
        self, messages: Sequence[ChatMessage], num_resumed: int, max_tokens: int | None
    ) -> list[int]:
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        except UnsupportedModelError as exc:
            raise BadRequestError(str(exc), param="messages") from exc
        except InvalidRequestError as exc:
            raise BadRequestError(
                f"the chat template refused the messages: {exc}", param="messages"
            ) from exc
        return self._encode(text, num_resumed, max_tokens, "messages")

    def _encode(self, text: str, num_resumed: int, max_tokens: int | None, param: str) -> list[int]:
        num_bytes = len(text.encode())
        # Below this no bound can refuse (a token is at least a byte): skip working it out.
        if num_bytes + num_resumed + (max_tokens or 1) > self.window.max_model_len:
            bytes_per_token = self.tokenizer.max_bytes_per_token
            if bytes_per_token is not None:
                num_at_least = -(-num_bytes // bytes_per_token)
                self.window.check(num_at_least + num_resumed, max_tokens, param, is_at_least=True)
        token_ids = self.tokenizer.encode(text)
        self.check(token_ids, num_resumed, max_tokens, param)
        return token_ids
