"""How a stream ends when the engine fails or aborts mid-way (engine outputs faked at the
iterator boundary; everything else real)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

from fake_engine import byte_tokenizer

from engine.errors import EngineDeadError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from node_agent.admission import Admission
from node_agent.metrics import NodeMetrics
from node_agent.responses import CHAT, ResponseHeader, TokenTexts
from node_agent.serving import PreparedRequest
from node_agent.streaming import RequestRun, chat_events, completion_events


def output(text: str, finish_reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, text, [1] if text else [], None, None, finish_reason)
    metrics = RequestMetrics(0.0, 0.0, 0.0, None)
    return RequestOutput("r", None, [1, 2], [completion], finish_reason is not None, 0, metrics)


async def failing_outputs(
    last: BaseException | RequestOutput,
) -> AsyncGenerator[RequestOutput, None]:
    yield output("Hello")
    if isinstance(last, BaseException):
        raise last
    yield last


def run_events(
    last: BaseException | RequestOutput, chat: bool
) -> tuple[list[bytes], Admission, NodeMetrics]:
    admission = Admission(10, 1)
    metrics = NodeMetrics("m", lambda: None)
    header = ResponseHeader("chatcmpl-x", 1, "m", CHAT, include_usage=True)
    prepared = PreparedRequest("chatcmpl-x", [1, 2], SamplingParams(), header, None, None)
    run = RequestRun(prepared, admission.admit(0), metrics.start_request(), "rid")
    events = (chat_events if chat else completion_events)(
        run, failing_outputs(last), TokenTexts(byte_tokenizer())
    )

    async def collect() -> list[bytes]:
        try:
            return [event async for event in events]
        finally:
            run.close()

    return asyncio.run(collect()), admission, metrics


def test_engine_death_mid_stream_ends_with_an_error_event_then_done() -> None:
    events, admission, metrics = run_events(EngineDeadError("boom"), True)
    assert events[-1].endswith(b"data: [DONE]\n\n")
    error = json.loads(events[-1].split(b"\n\n")[0][6:])["error"]
    assert error["code"] == "engine_dead" and error["type"] == "service_unavailable"
    assert b'"content":"Hello"' in events[1]
    assert admission.num_in_flight == 0
    assert b'request_success_total{finished_reason="abort",model_name="m"} 1.0' in metrics.render()


def test_an_engine_side_abort_is_reported_as_an_error() -> None:
    events, _, _ = run_events(output("", "abort"), False)
    assert b'"code":"aborted"' in events[-1] and events[-1].endswith(b"data: [DONE]\n\n")
    assert sum(event.count(b"[DONE]") for event in events) == 1


def test_a_finished_stream_sends_usage_then_done() -> None:
    events, _, metrics = run_events(output(" world", "stop"), True)
    usage = json.loads(events[-2][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == b"data: [DONE]\n\n"
    assert b'finished_reason="stop"' in metrics.render()
