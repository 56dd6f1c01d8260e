"""The agent API through a gateway (issue 33's "Done when"): the official `openai` client,
unmodified, over verified HTTPS against a real gateway in front of real node agents (the real
SmolLM2 in fp32, in processes of their own) in two regions: `parse` of 20 prompts, greedy and
sampled; `tool_choice: required` calls whose arguments validate, streamed and not (a non-stream
is assembled from the upstream stream, gateway/whole.py); a conversation with a tool result;
`n=4` with the prompt counted once; `frequency_penalty`; grammars that cannot run refused with
a 400 naming their field. Last, a JSON-schema stream and a tool stream whose node is killed
mid-way resume in the other region under the same grammar, their outputs those of unbroken runs
(fp32: see test_gw_resume_real_nodes.py)."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from agent_api_cases import (
    ARGUMENTS,
    ASK,
    CLOCK,
    WEATHER,
    check_four_choices,
    check_frequency_penalty,
    check_grammar_refusals,
    check_required_tool_calls,
    check_tool_result_conversation,
    unparsed_people,
)
from gw_fleet import Fleet, GatewayThread, wait_until
from openai.types.chat import ChatCompletionChunk
from test_gw_real_nodes import MAX_LOAD_S, fp32_regions

from engine.model_store import DEFAULT_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SERVING_TOKEN = "srv-" + "a" * 28  # nodes take resumed ids only from a gateway


@dataclass
class Stack:
    fleet: Fleet
    processes: dict[str, subprocess.Popen[bytes]]
    secret: str
    verify: ssl.SSLContext

    def gateway(self) -> GatewayThread:
        gateway = self.fleet.start_gateway(serving_token=SERVING_TOKEN)
        self.fleet.wait_for_gateway(gateway, num_regions=2, timeout_s=MAX_LOAD_S)
        wait_until(lambda: len(gateway.handlers.keys) > 0, 5.0, "the key snapshot")
        return gateway

    def client(self, gateway: GatewayThread) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=gateway.base_url + "/v1",
            api_key=self.secret,
            max_retries=0,
            http_client=httpx.Client(verify=self.verify, timeout=300.0),
        )


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    server_cert: tuple[Path, Path],
    client_ssl: ssl.SSLContext,
    smollm2_gguf: Path,
) -> Iterator[Stack]:
    tmp_path = tmp_path_factory.mktemp("agent-api")
    with fp32_regions(tmp_path, server_cert, SERVING_TOKEN) as (fleet, processes):
        _, secret = fleet.create_key()
        yield Stack(fleet, processes, secret, client_ssl)


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with stack.client(stack.gateway()) as client:
        yield client


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_parse_returns_a_parsed_object_for_every_prompt(
    client: openai.OpenAI, temperature: float
) -> None:
    assert unparsed_people(client, DEFAULT_MODEL, temperature) == []


def test_required_tool_calls_validate_streamed_and_not(client: openai.OpenAI) -> None:
    check_required_tool_calls(client, DEFAULT_MODEL)


def test_a_conversation_with_a_tool_result_continues(client: openai.OpenAI) -> None:
    check_tool_result_conversation(client, DEFAULT_MODEL)


def test_n_4_returns_4_choices_with_the_prompt_counted_once(client: openai.OpenAI) -> None:
    check_four_choices(client, DEFAULT_MODEL)


def test_frequency_penalty_changes_a_repeating_greedy_output(client: openai.OpenAI) -> None:
    check_frequency_penalty(client, DEFAULT_MODEL)


def test_a_grammar_that_cannot_run_is_400_naming_its_field(client: openai.OpenAI) -> None:
    check_grammar_refusals(client, DEFAULT_MODEL)


LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 5,
            "maxItems": 5,
        }
    },
    "required": ["cities"],
    "additionalProperties": False,
}
KILLED: dict[str, dict[str, Any]] = {
    "json_schema": {
        "messages": [{"role": "user", "content": "List five cities in Europe."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "cities", "schema": LIST_SCHEMA},
        },
    },
    "tool": {"messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required"},
}


def joined(chunks: list[ChatCompletionChunk]) -> tuple[str, list[tuple[str, str]], str]:
    """A stream's content, its calls (name and arguments joined) and its finish."""
    content, finish = "", ""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for item in choice.delta.tool_calls or ():
                assert item.function is not None
                call = calls.setdefault(item.index, ["", ""])
                call[0] += item.function.name or ""
                call[1] += item.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(n, a) for n, a in calls.values()], finish


def num_resumes(chunks: list[ChatCompletionChunk]) -> int:
    extras = [c.model_extra or {} for c in chunks if c.choices and c.choices[0].finish_reason]
    return int(extras[-1].get("meridian_resumes", 0)) if extras else 0


def test_constrained_and_tool_streams_resume_when_their_node_is_killed(
    stack: Stack, client: openai.OpenAI
) -> None:
    fields: dict[str, Any] = {
        "model": DEFAULT_MODEL,
        "temperature": 0,
        "max_tokens": 100,
        "stream": True,
    }
    unbroken = {
        kind: joined(list(client.chat.completions.create(**fields, **body)))
        for kind, body in KILLED.items()
    }
    # A fresh gateway: the first learnt from the runs above which region answers faster.
    with stack.client(stack.gateway()) as fresh, ExitStack() as streams:
        opened = {
            kind: streams.enter_context(
                fresh.chat.completions.with_streaming_response.create(**fields, **body)
            )
            for kind, body in KILLED.items()
        }
        regions = {kind: r.headers["x-meridian-region"] for kind, r in opened.items()}
        readers = {kind: iter(r.parse()) for kind, r in opened.items()}
        # Each stream has had its role chunk and 3 more when the first one's node dies (under
        # load the gateway may send both to either region).
        read = {kind: [next(reader) for _ in range(4)] for kind, reader in readers.items()}
        killed = regions["json_schema"]
        stack.processes[killed].send_signal(signal.SIGKILL)
        for kind, reader in readers.items():
            read[kind] += list(reader)
    for kind, chunks in read.items():
        assert num_resumes(chunks) == int(regions[kind] == killed), kind
        assert joined(chunks) == unbroken[kind], kind
    content, _, finish = unbroken["json_schema"]
    assert finish == "stop" and len(json.loads(content)["cities"]) == 5, content
    ((name, arguments),) = unbroken["tool"][1]
    ARGUMENTS[name].model_validate_json(arguments)
