"""From a validated OpenAI request to engine outputs: prompt, checks, sampling, the output stream.

Everything that can make a request fail with 400 happens in `prepare_*`, before any response
starts, so a stream never begins for a request the engine would refuse. A grammar is compiled
against the vocabulary here too (on the compiler's thread, cached by spec, as the engine core
compiles its own), so one that cannot run is refused before anything is queued.

`n` choices run as n engine requests (engine/parallel_sampling.py), at most `max_num_choices`.
Tools: with `tool_choice` none the tools are not shown to the model; otherwise the template
renders them (engine/tool_prompt.py when it has no tools section) and the output is parsed for
calls (node_agent/chat_choices.py); `required` and a named function are constrained by the
functions' schemas (node_agent/tool_plan.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from engine.async_engine import AsyncEngine
from engine.chat_template import ChatMessage, TemplateValue
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, RequestRejected
from engine.grammar import GrammarCompiler, GrammarError
from engine.grammar_spec import GrammarSpec
from engine.outputs import RequestOutput
from engine.parallel_sampling import generate_choices
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tool_prompt import TOOL_CALL_CLOSE
from node_agent.admission import Ticket
from node_agent.chat_choices import ToolParsing
from node_agent.errors import BadRequestError
from node_agent.metrics import RequestTimer
from node_agent.openai_schema import ChatCompletionRequest, CompletionRequest, SamplingRequest
from node_agent.prompts import PromptEncoder, client_error
from node_agent.responses import CHAT, COMPLETION, ResponseHeader, ResponseKind, TokenTexts
from node_agent.tool_plan import tool_plan

DEFAULT_MAX_NUM_CHOICES = 8

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
    num_choices: int = 1
    tools: ToolParsing | None = None  # None: the output is text only

    @property
    def num_prompt_tokens(self) -> int:
        """What the engine prefills, the resumed output included (the usage's prompt)."""
        return len(self.prompt_token_ids) + len(self.resumed_token_ids)


class Serving:
    """Serves one loaded model."""

    def __init__(
        self, llm: AsyncEngine, model_name: str, max_num_choices: int = DEFAULT_MAX_NUM_CHOICES
    ):
        self.llm = llm
        self.model_name = model_name
        self.max_num_choices = max_num_choices
        self.texts = TokenTexts(llm.tokenizer)
        self.prompts = PromptEncoder(llm.tokenizer, llm.limits)
        self.grammars = GrammarCompiler(llm.tokenizer, llm.limits.vocab_size)

    async def prepare_chat(
        self, body: ChatCompletionRequest, cache_salt: str | None
    ) -> PreparedRequest:
        messages: list[ChatMessage] = []
        for message in body.messages:
            entry: dict[str, TemplateValue] = {
                "role": _ROLE_ALIASES.get(message.role, message.role),
                "content": message.text,
            }
            if message.name:
                entry["name"] = message.name
            if message.tool_calls:
                entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            messages.append(entry)
        plan = tool_plan(body)
        tools = plan.parsing if plan is not None else None
        shown = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        num_resumed = len(body.resume_token_ids or ())
        token_ids = await self.prompts.encode_chat(
            messages,
            num_resumed,
            body.max_output_tokens,
            shown if tools is not None else None,
            tools.forced_prefix if tools is not None else "",
        )
        params = self._params(body, body.max_output_tokens, body.engine_logprobs)
        if tools is not None and tools.max_calls == 1:
            params.stop = [*params.stop, TOOL_CALL_CLOSE]
        if tools is not None and body.resume_token_ids:
            resumed_text = self._streamed_text(body.resume_token_ids, params)
            tools = replace(tools, resumed_text=resumed_text)
        if plan is not None and plan.grammar is not None:
            if params.grammar is not None:
                raise BadRequestError(
                    "a required or named tool_choice constrains the output itself: it does not "
                    "combine with response_format, guided_regex or guided_choice",
                    param="tool_choice",
                )
            params.grammar = plan.grammar
        prepared = self._prepared(
            CHAT, "messages", token_ids, params, body, body.engine_logprobs, cache_salt
        )
        prepared.tools = tools
        is_tools = plan is not None and plan.grammar is not None
        await self._check_compiles(params.grammar, "tools" if is_tools else None)
        return prepared

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
        prepared = self._prepared(
            COMPLETION, "prompt", token_ids, params, body, body.logprobs, cache_salt
        )
        await self._check_compiles(params.grammar)
        return prepared

    async def _check_compiles(self, grammar: GrammarSpec | None, param: str | None = None) -> None:
        """A 400 naming `param` (else the grammar's own field) if the grammar does not compile
        against the vocabulary, or no token can start it; it waits off the event loop."""
        if grammar is None:
            return
        try:
            await asyncio.wrap_future(self.grammars.compile(grammar))
        except GrammarError as exc:
            raise BadRequestError(str(exc), param=param or grammar.param) from exc

    async def outputs(
        self, prepared: PreparedRequest, ticket: Ticket, timer: RequestTimer
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's delta outputs; closing this iterator early aborts the request."""
        stream = generate_choices(
            self.llm,
            prepared.prompt_token_ids,
            prepared.params,
            prepared.request_id,
            prepared.num_choices,
            prepared.cache_salt,
            prepared.resumed_token_ids or None,
        )
        async with aclosing(stream) as outputs:
            async for output in outputs:
                if output.outputs[0].token_ids:
                    ticket.mark_started()
                if output.outputs[0].index == 0:  # latencies as one stream's: the first's
                    timer.on_output(output)
                yield output

    def _streamed_text(self, resumed_token_ids: list[int], params: SamplingParams) -> str:
        """The text an earlier attempt streamed for these output ids: what the engine takes
        as sent when it resumes them (engine/request_state.py), the tail a stop string could
        still be forming in held back."""
        detokenizer = IncrementalDetokenizer(
            self.llm.tokenizer, skip_special_tokens=params.skip_special_tokens
        )
        text = "".join(detokenizer.push(token_id) for token_id in resumed_token_ids)
        max_stop_len = max((len(stop) for stop in params.stop), default=0)
        if max_stop_len:
            return text[: max(len(text) - max_stop_len + 1, 0)]
        return text

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
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0,
                logit_bias=body.engine_logit_bias,
                min_tokens=body.min_tokens,
                stop_token_ids=body.stop_token_ids or [],
                grammar=body.grammar,
            )
        except InvalidRequestError as exc:
            param = exc.param if isinstance(exc, RequestRejected) else None
            raise BadRequestError(str(exc), param=param) from exc

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
        if body.n > self.max_num_choices:
            raise BadRequestError(
                f"n is {body.n}: this node makes at most {self.max_num_choices} choices a request",
                param="n",
            )
        if body.n > 1 and resumed:
            raise BadRequestError("a resumed request has one choice", param="n")
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
            body.n,
        )
