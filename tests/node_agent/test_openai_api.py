"""The official `openai` client against a node agent serving the real SmolLM2."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from node_helpers import MODEL_NAME, NodeHandle
from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.slow

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
ANSWER = "The capital of France is Paris."


@pytest.fixture
def client(openai_client: openai.OpenAI) -> openai.OpenAI:
    return openai_client


@pytest_asyncio.fixture
async def async_client(real_node: NodeHandle) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=real_node.base_url + "/v1", api_key="unused", max_retries=0
    )
    yield client
    await client.close()


def test_greedy_chat_answers_the_capital_of_france(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=20
    )
    choice = reply.choices[0]
    assert choice.message.content == ANSWER
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == 37
    assert reply.usage.completion_tokens == 8  # seven words and <|im_end|>
    assert reply.usage.total_tokens == 45


def test_streaming_chat_sends_openai_chunks_and_usage_last(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.asyncio
async def test_async_client_streams_completions(async_client: openai.AsyncOpenAI) -> None:
    stream = await async_client.completions.create(
        model=MODEL_NAME,
        prompt="The capital of France is",
        temperature=0,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(" Paris")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.asyncio
async def test_async_client_chat_without_stream(async_client: openai.AsyncOpenAI) -> None:
    reply = await async_client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, temperature=0, max_completion_tokens=20
    )
    assert reply.choices[0].message.content == ANSWER


def test_completion_with_logprobs_and_token_ids_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", temperature=0, max_tokens=3, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens is not None and len(choice.logprobs.tokens) == 3
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.top_logprobs is not None
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset == [
        0,
        len(choice.logprobs.tokens[0]),
        len("".join(choice.logprobs.tokens[:2])),
    ]
    # The same prompt as token ids gives the same greedy text.
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    again = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=3)
    assert again.choices[0].text == choice.text
    assert again.usage is not None and again.usage.prompt_tokens == 5


def test_chat_logprobs_report_tokens_bytes_and_top_candidates(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        temperature=0,
        max_tokens=20,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert "".join(t.token for t in content[:7]) == ANSWER
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0.0
        assert bytes(entry.bytes or []).decode() == entry.token
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token


def test_stop_string_ends_the_reply_before_it(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=20, stop=[" Paris"]
    )
    assert reply.choices[0].message.content == "The capital of France is"
    assert reply.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon a time",
            temperature=1.0,
            max_tokens=12,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_a_completion_with_max_tokens_null_stops_at_openais_default_of_16(
    real_node: NodeHandle,
) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": None, "ignore_eos": True}
    with real_node.client() as http:
        answer = http.post("/v1/completions", json=body).json()
    assert answer["usage"]["completion_tokens"] == 16
    assert answer["choices"][0]["finish_reason"] == "length"
