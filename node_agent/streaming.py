"""Turning a request's engine outputs into an OpenAI response: SSE events or one JSON body.

A `RequestRun` follows one admitted request to its end, however it ends (finished, failed, or the
client gone): it releases the admission ticket, records the latency metrics and logs one line.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.errors import EngineError
from engine.outputs import RequestOutput
from engine.sequence import TokenLogprobs
from node_agent.admission import Ticket
from node_agent.chat_choices import ChatChoice, ToolParsing
from node_agent.errors import BadRequestError, NodeAgentError, UnavailableError, from_engine
from node_agent.metrics import RequestTimer
from node_agent.responses import (
    DONE,
    JSON,
    CompletionLogprobs,
    TokenTexts,
    Usage,
    chat_logprobs,
    error_event,
)
from node_agent.serving import PreparedRequest

logger = logging.getLogger(__name__)

Outputs = AsyncGenerator[RequestOutput, None]


@dataclass(slots=True)
class RequestRun:
    prepared: PreparedRequest
    ticket: Ticket
    timer: RequestTimer
    client_request_id: str
    usage: Usage = field(init=False)
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> reason
    last_output: RequestOutput | None = None
    is_closed: bool = False
    # What failed, where the engine ended a choice with "error" (its grammar could not go on).
    error: str | None = None

    def __post_init__(self) -> None:
        self.usage = Usage(self.prepared.num_prompt_tokens)

    @property
    def finish_reason(self) -> str | None:
        """The request's: the first choice's (every choice's once all have finished)."""
        if len(self.finish_reasons) < self.prepared.num_choices:
            return None
        return self.finish_reasons[0]

    @property
    def is_aborted(self) -> bool:
        return self.finish_reason is None or "abort" in self.finish_reasons.values()

    def record(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        self.usage.completion_tokens += len(completion.token_ids)
        if completion.index == 0:  # the prompt counts once: as its first choice found it
            self.usage.cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reasons[completion.index] = completion.finish_reason or "abort"
            self.last_output = output
        if completion.finish_reason == "error":
            self.error = str(completion.stop_reason)

    def close(self) -> None:
        """The request is over (idempotent): free its place, record and log it."""
        if self.is_closed:
            return
        self.is_closed = True
        reason = "abort" if self.is_aborted else self.finish_reason or "abort"
        elapsed_s = self.timer.finish(self.last_output, reason)
        self.ticket.release()
        logger.info(
            "%s x-request-id=%s finish=%s n=%d prompt=%d completion=%d cached=%d e2e=%.3fs",
            self.prepared.request_id,
            self.client_request_id,
            reason,
            self.prepared.num_choices,
            self.usage.prompt_tokens,
            self.usage.completion_tokens,
            self.usage.cached_tokens,
            elapsed_s,
        )


def _aborted() -> UnavailableError:
    return UnavailableError("the request was aborted: the node is shutting down", code="aborted")


def _grammar_failed(error: str) -> BadRequestError:
    # The request's own grammar could not go on (a choice or regex the vocabulary cannot
    # spell, say): the client's to change.
    message = f"the output cannot follow the requested format: {error}"
    return BadRequestError(message, code="grammar_error")


def chat_events(run: RequestRun, outputs: Outputs, texts: TokenTexts) -> AsyncIterator[bytes]:
    header = run.prepared.header
    num_top = run.prepared.num_top_logprobs
    with_ids = run.prepared.return_token_ids
    choices = [ChatChoice(i, run.prepared.tools) for i in range(run.prepared.num_choices)]
    roles = [
        header.chunk({"delta": {"role": "assistant", "content": ""}}, index=c.index)
        for c in choices
    ]

    def chunks(item: RequestOutput) -> Iterator[bytes]:
        completion = item.outputs[0]
        choice = choices[completion.index]
        delta = choice.feed(completion.text)
        if item.finished:
            delta |= choice.finish(completion.finish_reason)
        logprobs = _chat_logprobs(texts, completion.logprobs, num_top)
        # With ids asked for, every output that has ids is a chunk: the ids a client holds
        # then always match the text it holds (what a resume continues from).
        if delta or logprobs is not None or (with_ids and completion.token_ids):
            yield header.chunk(
                {"delta": delta or {"content": ""}},
                logprobs=logprobs,
                token_ids=completion.token_ids,
                index=choice.index,
            )
        if item.finished:
            yield header.chunk({"delta": {}}, choice.finish_reason, index=choice.index)

    return _events(run, outputs, roles, chunks)


def completion_events(run: RequestRun, outputs: Outputs, texts: TokenTexts) -> AsyncIterator[bytes]:
    header = run.prepared.header
    num_top = run.prepared.num_top_logprobs
    with_ids = run.prepared.return_token_ids
    logprobs = [
        CompletionLogprobs(texts, num_top) if num_top is not None else None
        for _ in range(run.prepared.num_choices)
    ]

    def chunks(item: RequestOutput) -> Iterator[bytes]:
        completion = item.outputs[0]
        choice_logprobs = logprobs[completion.index]
        lp = (
            choice_logprobs.next(completion.logprobs)
            if choice_logprobs and completion.logprobs
            else None
        )
        finish_reason = completion.finish_reason if item.finished else None
        has_ids = with_ids and bool(completion.token_ids)
        if completion.text or lp is not None or finish_reason is not None or has_ids:
            yield header.chunk(
                {"text": completion.text},
                finish_reason,
                lp,
                completion.token_ids,
                completion.index,
            )

    return _events(run, outputs, [], chunks)


async def _events(
    run: RequestRun,
    outputs: Outputs,
    opening: list[bytes],
    chunks: Callable[[RequestOutput], Iterator[bytes]],
) -> AsyncGenerator[bytes, None]:
    """One stream's events, either endpoint's: the `opening` chunks, `chunks` of each output,
    the usage chunk if the client asked for it and `[DONE]`; or, once a failure ends the
    outputs, its error event and `[DONE]` as the last words."""
    header = run.prepared.header
    async with aclosing(_guarded(run, outputs)) as stream:
        for chunk in opening:
            yield chunk
        async for item in stream:
            if isinstance(item, bytes):
                yield item
                return
            for chunk in chunks(item):
                yield chunk
    if header.include_usage:
        yield header.usage_chunk(run.usage)
    yield DONE


async def _guarded(
    run: RequestRun, outputs: Outputs
) -> AsyncGenerator[RequestOutput | bytes, None]:
    """Outputs as they come, recorded in `run`; a failure ends them with one bytes item, the
    error event and `[DONE]`, which the caller sends as the stream's last words."""
    try:
        async with aclosing(outputs) as stream:
            async for output in stream:
                run.record(output)
                if run.error is not None:
                    raise _grammar_failed(run.error)
                if output.finished and output.outputs[0].finish_reason == "abort":
                    raise _aborted()
                yield output
    except (EngineError, NodeAgentError) as exc:
        error = exc if isinstance(exc, NodeAgentError) else from_engine(exc)
        logger.warning("%s failed mid-stream: %s", run.prepared.request_id, error.message)
        yield error_event(error.status_code, error.message, error.code) + DONE


async def collect_chat(run: RequestRun, outputs: Outputs, texts: TokenTexts) -> JSON:
    header = run.prepared.header
    num_top = run.prepared.num_top_logprobs
    choices = await _collect(run, outputs, run.prepared.tools)
    bodies = [
        header.choice(
            c.index,
            {"message": c.message()},
            c.finish_reason,
            _chat_logprobs(texts, c.logprobs, num_top),
            c.token_ids,
        )
        for c in choices
    ]
    return header.body(bodies, run.usage)


async def collect_completion(run: RequestRun, outputs: Outputs, texts: TokenTexts) -> JSON:
    header = run.prepared.header
    num_top = run.prepared.num_top_logprobs
    bodies = []
    for c in await _collect(run, outputs, None):
        lp = CompletionLogprobs(texts, num_top).next(c.logprobs) if num_top is not None else None
        text: JSON = {"text": "".join(c.parts)}
        bodies.append(header.choice(c.index, text, c.finish_reason, lp, c.token_ids))
    return header.body(bodies, run.usage)


async def _collect(
    run: RequestRun, outputs: Outputs, tools: ToolParsing | None
) -> list[ChatChoice]:
    choices = [ChatChoice(i, tools) for i in range(run.prepared.num_choices)]
    async with aclosing(outputs) as stream:
        async for output in stream:
            run.record(output)
            completion = output.outputs[0]
            choice = choices[completion.index]
            choice.feed(completion.text)
            choice.token_ids.extend(completion.token_ids)
            choice.logprobs.extend(completion.logprobs or ())
            if output.finished:
                choice.finish(completion.finish_reason)
    if run.error is not None:
        raise _grammar_failed(run.error)
    if run.is_aborted:
        raise _aborted()
    return choices


def _chat_logprobs(
    texts: TokenTexts, logprobs: list[TokenLogprobs] | None, num_top: int | None
) -> JSON | None:
    if num_top is None or not logprobs:
        return None
    return chat_logprobs(texts, logprobs, num_top)


class EventStreamResponse(StreamingResponse):
    """An SSE response that always runs `on_close` and closes its body, even if the client left
    before the first byte (Starlette then never starts the body iterator)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ):
        super().__init__(content, headers={"Cache-Control": "no-cache", **(headers or {})})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                await aclose()
            self._on_close()
