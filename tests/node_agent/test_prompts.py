"""Prompts into token ids (node_agent/prompts.py) on the real SmolLM2 tokenizer, no engine: the
byte bound that refuses a prompt unencoded, and encoding that leaves the event loop running."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.errors import RequestRejected
from engine.request_limits import RequestLimits
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from node_agent.errors import BadRequestError, ContextLengthExceededError
from node_agent.prompts import PromptEncoder, client_error

# SmolLM2's longest token: a newline and 80 spaces (81 bytes).
LONGEST_TOKEN = "\n" + " " * 80
MAX_EVENT_LOOP_GAP_S = 0.5


def encoder(tokenizer: Tokenizer, max_model_len: int) -> PromptEncoder:
    return PromptEncoder(tokenizer, RequestLimits(max_model_len, tokenizer.vocab_size))


def test_no_text_encodes_to_fewer_tokens_than_its_bytes_over_the_bound(
    tokenizer: Tokenizer,
) -> None:
    assert tokenizer.max_bytes_per_token == len(LONGEST_TOKEN.encode())
    # The bound is met exactly by the longest token repeated, and holds for other texts.
    texts = [LONGEST_TOKEN * 50, "<|im_start|>" * 20, "héllo wörld 🤖 " * 30, "a" * 500]
    for text in texts:
        num_at_least = -(-len(text.encode()) // tokenizer.max_bytes_per_token)
        assert len(tokenizer.encode(text)) >= num_at_least
    assert len(tokenizer.encode(LONGEST_TOKEN * 50)) == 50


def test_a_prompt_its_bytes_prove_too_long_is_refused_before_encoding(
    tokenizer: Tokenizer,
) -> None:
    prompts = encoder(tokenizer, 1024)
    text = LONGEST_TOKEN * 1000  # at least 1,000 tokens by its bytes alone
    with pytest.raises(ContextLengthExceededError, match="has at least 1030 tokens") as refused:
        asyncio.run(prompts.encode_text(text, num_resumed=30, max_tokens=None))
    assert refused.value.param == "prompt"
    # With room for the prompt but not for max_tokens too, max_tokens is named.
    with pytest.raises(ContextLengthExceededError, match="requested at least 1100") as refused:
        asyncio.run(prompts.encode_text(text, num_resumed=0, max_tokens=100))
    assert refused.value.param == "max_tokens"


def test_a_prompt_within_the_bound_is_encoded_for_the_engines_exact_check(
    tokenizer: Tokenizer,
) -> None:
    prompts = encoder(tokenizer, 1024)
    text = " hello" * 1100  # 6,600 bytes: no proof from bytes, 1,100 tokens when encoded
    ids = asyncio.run(prompts.encode_text(text, num_resumed=0, max_tokens=None))
    assert len(ids) == 1100
    # The exact count, resumed ids included, is the engine's check's (test_request_limits.py).
    with pytest.raises(RequestRejected, match="has 1100 tokens"):
        prompts.limits.check(ids, SamplingParams())


def test_a_chat_is_bounded_after_its_template_renders(tokenizer: Tokenizer) -> None:
    prompts = encoder(tokenizer, 1024)
    messages = [{"role": "user", "content": LONGEST_TOKEN * 2000}]
    with pytest.raises(ContextLengthExceededError, match="at least") as refused:
        asyncio.run(prompts.encode_chat(messages, num_resumed=0, max_tokens=None))
    assert refused.value.param == "messages"
    ids = asyncio.run(prompts.encode_chat([{"role": "user", "content": "Hi"}], 0, None))
    assert ids == tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "Hi"}]))


def test_encoding_megabytes_leaves_the_event_loop_running(tokenizer: Tokenizer) -> None:
    """The tokenizer holds no GIL while it encodes: a loop-latency probe keeps ticking."""
    prompts = encoder(tokenizer, 10_000_000)  # a context so large that the text gets encoded
    text = " The quick brown fox jumps over the lazy dog." * 60_000  # 2.7 MB

    async def run() -> tuple[int, float]:
        encoding = asyncio.create_task(prompts.encode_text(text, 0, None))
        longest_gap_s = 0.0
        last_s = time.monotonic()
        while not encoding.done():
            await asyncio.sleep(0.01)
            now_s = time.monotonic()
            longest_gap_s = max(longest_gap_s, now_s - last_s)
            last_s = now_s
        return len(await encoding), longest_gap_s

    num_tokens, longest_gap_s = asyncio.run(run())
    assert num_tokens == 600_000
    assert longest_gap_s < MAX_EVENT_LOOP_GAP_S


def test_an_engine_refusal_names_the_bodys_field() -> None:
    too_long = client_error(RequestRejected("prompt", "long", exceeds_context=True), "messages")
    assert isinstance(too_long, ContextLengthExceededError)
    assert (too_long.message, too_long.param, too_long.code) == (
        "long",
        "messages",
        "context_length_exceeded",
    )
    bad_ids = client_error(RequestRejected("resumed_token_ids", "bad ids"), "prompt")
    assert type(bad_ids) is BadRequestError and bad_ids.param == "resume_token_ids"
    assert client_error(RequestRejected("max_tokens", "m", True), "prompt").param == "max_tokens"
