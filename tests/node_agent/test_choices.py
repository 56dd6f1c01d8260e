"""`n` choices of one prompt, against a node agent serving the real SmolLM2: one prompt's blocks
computed once, a seed stream per choice, streamed with indices, the prompt counted once."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from agent_api_cases import check_four_choices
from node_helpers import MODEL_NAME, NodeHandle
from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write one sentence about the sea."}
]
CHAT = "/v1/chat/completions"


@pytest.fixture
def http(real_node: NodeHandle) -> Iterator[httpx.Client]:
    with real_node.client() as client:
        yield client


def sampled(http: httpx.Client, n: int, seed: int, **extra: object) -> dict[str, object]:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "n": n, "seed": seed, "max_tokens": 12}
    response = http.post(CHAT, json=body | {"temperature": 1.0} | extra)
    assert response.status_code == 200, response.text
    reply: dict[str, object] = response.json()
    return reply


def texts(reply: dict[str, object]) -> list[str]:
    choices = reply["choices"]
    assert isinstance(choices, list)
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c["message"]["content"] for c in choices]


def test_n_4_returns_4_choices_with_the_prompt_counted_and_computed_once(
    real_node: NodeHandle, http: httpx.Client
) -> None:
    salt = uuid.uuid4().hex  # a prompt no earlier request cached
    before = real_node.stats()
    reply = sampled(http, 4, 11, cache_salt=salt, return_token_ids=True)
    after = real_node.stats()
    single = sampled(http, 1, 11, cache_salt=uuid.uuid4().hex)
    assert len(texts(reply)) == 4
    usage, single_usage = reply["usage"], single["usage"]
    assert isinstance(usage, dict) and isinstance(single_usage, dict)
    num_prompt = single_usage["prompt_tokens"]
    assert usage["prompt_tokens"] == num_prompt  # once, not 4 times
    choices = reply["choices"]
    assert isinstance(choices, list)
    assert usage["completion_tokens"] == sum(len(token_ids(c)) for c in choices)
    # The first choice computes every full block of the prompt; the other three find them all
    # and compute only the last, partial block (and the last token).
    block_size = after.block_size
    shared = (num_prompt - 1) // block_size * block_size
    assert after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens == 4 * num_prompt
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 3 * shared
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # as the first choice found it


def token_ids(choice: dict[str, object]) -> list[int]:
    ids = choice["token_ids"]
    assert isinstance(ids, list)
    return ids


def test_each_choice_has_its_own_reproducible_seed_stream(http: httpx.Client) -> None:
    # Each computed from scratch (a fresh salt), so both run the same steps: a prompt found cached
    # computes only its last block, in steps of other shapes, whose sums (and so sampling at
    # temperature 1, on a near tie) may part. Which seed each choice draws from:
    # tests/engine/test_parallel_sampling.py.
    first = texts(sampled(http, 3, 7, cache_salt=uuid.uuid4().hex))
    assert len(set(first)) == 3  # each choice drew its own tokens
    assert texts(sampled(http, 3, 7, cache_salt=uuid.uuid4().hex)) == first  # and draws them again
    assert texts(sampled(http, 3, 8, cache_salt=uuid.uuid4().hex)) != first  # another seed


def test_streamed_choices_carry_their_index_and_match_the_whole_answer(
    http: httpx.Client,
) -> None:
    # Both computed from scratch (a fresh salt each): a prompt cached for one and not the other
    # is prefilled in other shapes, and sampling at temperature 1 once parted on a near tie.
    whole = texts(sampled(http, 3, 5, cache_salt=uuid.uuid4().hex))
    body = {
        "cache_salt": uuid.uuid4().hex,
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "n": 3,
        "seed": 5,
        "temperature": 1.0,
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    roles: list[int] = []
    finishes: list[int] = []
    usages: list[dict[str, object]] = []
    with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usages.append(chunk["usage"])
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if "role" in delta:
                    roles.append(choice["index"])
                parts[choice["index"]].append(delta.get("content") or "")
                if choice["finish_reason"] is not None:
                    finishes.append(choice["index"])
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]
    assert ["".join(parts[i]) for i in range(3)] == whole
    assert len(usages) == 1


def test_the_openai_client_reads_n_choices(openai_client: openai.OpenAI) -> None:
    reply = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=4, max_tokens=8, seed=3
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    completion = openai_client.completions.create(
        model=MODEL_NAME, prompt="The sea is", n=2, max_tokens=6, seed=3
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text != completion.choices[1].text
    check_four_choices(openai_client, MODEL_NAME)  # the prompt counted once, streamed the same
