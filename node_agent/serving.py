"""From a validated OpenAI request to engine outputs: prompt, checks, sampling, the output stream.

Everything that can make a request fail with 400 happens in `prepare_*`, before any response
starts, so a stream never begins for a request the engine would refuse.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine
from engine.chat_template import ChatMessage
from engine.errors import InvalidRequestError, RequestRejected
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from node_agent.admission import Ticket
from node_agent.errors import BadRequestError
from node_agent.metrics import RequestTimer
from node_agent.openai_schema import ChatCompletionRequest, CompletionRequest, SamplingRequest
from node_agent.prompts import PromptEncoder, client_error
from node_agent.responses import CHAT, COMPLETION, ResponseHeader, ResponseKind, TokenTexts

# OpenAI's name for the system role in newer models; chat templates know only "system".
_ROLE_ALIASES = {"developer": "system"}


@dataclass(slots=True)
class PreparedRequest:
    request_id: str  # the response's id, and the engine's request id
    prompt_token_ids: list[int]
    params: SamplingParams
    header: ResponseHeader
    num_top_logprobs: int | None  # None: no logprobs asked for
    cache_salt: str | None
    # An earlier attempt's output that this one continues (wire/resume.py); empty if none.
    resumed_token_ids: list[int] = field(default_factory=list)
    return_token_ids: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        """What the engine prefills, the resumed output included (the usage's prompt)."""
        return len(self.prompt_token_ids) + len(self.resumed_token_ids)


class Serving:
    """Serves one loaded model."""

    def __init__(self, llm: AsyncEngine, model_name: str):
        self.llm = llm
        self.model_name = model_name
        self.texts = TokenTexts(llm.tokenizer)
        self.prompts = PromptEncoder(llm.tokenizer, llm.limits)

    async def prepare_chat(
        self, body: ChatCompletionRequest, cache_salt: str | None
    ) -> PreparedRequest:
        messages: list[ChatMessage] = []
        for message in body.messages:
            entry: dict[str, str] = {
                "role": _ROLE_ALIASES.get(message.role, message.role),
                "content": message.text,
            }
            if message.name:
                entry["name"] = message.name
            messages.append(entry)
        num_resumed = len(body.resume_token_ids or ())
        token_ids = await self.prompts.encode_chat(messages, num_resumed, body.max_output_tokens)
        params = self._params(body, body.max_output_tokens, body.engine_logprobs)
        return self._prepared(
            CHAT, "messages", token_ids, params, body, body.engine_logprobs, cache_salt
        )

    async def prepare_completion(
        self, body: CompletionRequest, cache_salt: str | None
    ) -> PreparedRequest:
        prompt = body.single_prompt
        num_resumed = len(body.resume_token_ids or ())
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequestError("the prompt is empty", param="prompt")
            token_ids = await self.prompts.encode_text(prompt, num_resumed, body.max_tokens)
        else:
            token_ids = prompt
        params = self._params(body, body.max_tokens, body.logprobs)
        return self._prepared(
            COMPLETION, "prompt", token_ids, params, body, body.logprobs, cache_salt
        )

    async def outputs(
        self, prepared: PreparedRequest, ticket: Ticket, timer: RequestTimer
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's delta outputs; closing this iterator early aborts the request."""
        stream = self.llm.generate(
            prepared.prompt_token_ids,
            prepared.params,
            prepared.request_id,
            prepared.cache_salt,
            prepared.resumed_token_ids or None,
        )
        async with aclosing(stream) as outputs:
            async for output in outputs:
                if output.outputs[0].token_ids:
                    ticket.mark_started()
                timer.on_output(output)
                yield output

    def _params(
        self, body: SamplingRequest, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=body.seed,
                max_tokens=max_tokens,
                stop=body.stop_strings,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                output_kind=RequestOutputKind.DELTA,
            )
        except InvalidRequestError as exc:
            raise BadRequestError(str(exc)) from exc

    def _prepared(
        self,
        kind: ResponseKind,
        prompt_param: str,
        token_ids: list[int],
        params: SamplingParams,
        body: SamplingRequest,
        num_top_logprobs: int | None,
        cache_salt: str | None,
    ) -> PreparedRequest:
        resumed = list(body.resume_token_ids or ())
        try:
            # OpenAI's rule: the prompt and max_tokens together must fit in the context.
            self.llm.limits.check(token_ids, params, resumed, cache_salt, clamp_max_tokens=False)
        except RequestRejected as exc:
            raise client_error(exc, prompt_param) from exc
        request_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        header = ResponseHeader(
            request_id,
            int(time.time()),
            body.model,
            kind,
            body.include_usage,
            body.return_token_ids,
            token_ids + resumed,
        )
        return PreparedRequest(
            request_id,
            token_ids,
            params,
            header,
            num_top_logprobs,
            cache_salt,
            resumed,
            body.return_token_ids,
        )
