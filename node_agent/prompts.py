"""A request's prompt as token ids, made off the event loop, and the bound that refuses it
unencoded.

The event loop sends heartbeats and answers probes, so the chat template renders and the
tokenizer encodes in a worker thread (the engine's tokenizer releases the GIL while it encodes:
seconds for a few megabytes). Before encoding, a cheap bound: no token stands for more than the
tokenizer's `max_bytes_per_token` bytes of text, so text of B UTF-8 bytes is at least
ceil(B / that) tokens; when those alone leave no room in the context, the prompt is refused
unencoded. A byte count can only prove a prompt too long, never short enough (a token usually
covers several bytes), so every prompt that passes is encoded, then checked exactly by the
engine's check (engine/request_limits.py, from node_agent/serving.py).

Resumed output ids (wire/resume.py) take room in the context like the prompt: the bound counts
them in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.chat_template import ChatMessage, TemplateValue
from engine.errors import InvalidRequestError, RequestRejected, UnsupportedModelError
from engine.request_limits import RequestLimits
from engine.tokenizer import Tokenizer
from node_agent.errors import BadRequestError, ContextLengthExceededError


def client_error(exc: RequestRejected, prompt_param: str) -> BadRequestError:
    """The 400 for a request the engine's check refused, naming the body's field for the
    engine's argument: the prompt is `prompt_param` ("prompt" or "messages")."""
    fields = {"prompt": prompt_param, "resumed_token_ids": "resume_token_ids"}
    param = fields.get(exc.param, exc.param)
    error = ContextLengthExceededError if exc.exceeds_context else BadRequestError
    return error(exc.message, param=param)


@dataclass(frozen=True, slots=True)
class PromptEncoder:
    tokenizer: Tokenizer
    limits: RequestLimits

    async def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        num_resumed: int,
        max_tokens: int | None,
        tools: Sequence[Mapping[str, TemplateValue]] | None = None,
        output_prefix: str = "",
    ) -> list[int]:
        """The chat's prompt ids (template rendered with `tools`, generation prompt added, then
        `output_prefix`: the reply's start, which the model continues), or a 400."""
        return await asyncio.to_thread(
            self._encode_chat, messages, num_resumed, max_tokens, tools, output_prefix
        )

    async def encode_text(self, text: str, num_resumed: int, max_tokens: int | None) -> list[int]:
        """The prompt text's ids, or a 400."""
        return await asyncio.to_thread(self._encode, text, num_resumed, max_tokens, "prompt")

    def _encode_chat(
        self,
        messages: Sequence[ChatMessage],
        num_resumed: int,
        max_tokens: int | None,
        tools: Sequence[Mapping[str, TemplateValue]] | None,
        output_prefix: str,
    ) -> list[int]:
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)
        except UnsupportedModelError as exc:
            raise BadRequestError(str(exc), param="messages") from exc
        except InvalidRequestError as exc:
            raise BadRequestError(
                f"the chat template refused the messages: {exc}", param="messages"
            ) from exc
        return self._encode(text + output_prefix, num_resumed, max_tokens, "messages")

    def _encode(self, text: str, num_resumed: int, max_tokens: int | None, param: str) -> list[int]:
        num_bytes = len(text.encode())
        # Below this no bound can refuse (a token is at least a byte): skip working it out.
        if num_bytes + num_resumed + (max_tokens or 1) > self.limits.max_model_len:
            bytes_per_token = self.tokenizer.max_bytes_per_token
            if bytes_per_token is not None:
                num_at_least = -(-num_bytes // bytes_per_token)
                try:
                    self.limits.check_fits(num_at_least + num_resumed, max_tokens, is_at_least=True)
                except RequestRejected as exc:
                    raise client_error(exc, param) from exc
        return self.tokenizer.encode(text)
