"""The engine's public API on the real model: outputs, stop conditions, seeds, bad input,
and the async engine's streaming and aborts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from real_model import KV_CACHE_GIB

from engine import LLM, SamplingParams, TokensPrompt
from engine.async_llm import AsyncLLM
from engine.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Tell me a short story about a robot."}]


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    return LLM(str(smollm2_gguf), max_model_len=256, cpu_kv_cache_gib=KV_CACHE_GIB)  # default dtype


def test_one_output_per_prompt_in_order_with_consistent_text(llm: LLM) -> None:
    prompts = ["The capital of Italy is", "1, 2, 3, 4,", "Once upon a time"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    tokenizer = llm.get_tokenizer()
    assert [o.prompt for o in outs] == prompts
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and len(completion.token_ids) <= 8
        assert completion.text == tokenizer.decode(completion.token_ids)
        assert out.prompt_token_ids == tokenizer.encode(out.prompt or "")


def test_max_tokens_and_ignore_eos_give_exactly_that_many_tokens(llm: LLM) -> None:
    [out] = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_stop_string_cuts_the_text_and_names_the_stop(llm: LLM) -> None:
    [full] = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40))
    text = full.outputs[0].text
    stop = text.split()[3]  # a word from the middle of the greedy reply
    [cut] = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    [kept] = llm.chat(
        CHAT,
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
    )
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_stop_token_id_ends_the_request(llm: LLM) -> None:
    [full] = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20))
    ids = full.outputs[0].token_ids
    [cut] = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[4]]))
    assert cut.outputs[0].token_ids == ids[: ids.index(ids[4]) + 1]
    assert cut.outputs[0].stop_reason == ids[4]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    [alone] = llm.chat(CHAT, seeded)
    crowd = llm.generate(
        ["Hello", llm.get_tokenizer().render_chat(CHAT), "Another prompt here"],
        [SamplingParams(temperature=1.0, max_tokens=30), seeded, SamplingParams(temperature=0)],
    )
    assert crowd[1].outputs[0].token_ids == alone.outputs[0].token_ids
    [other] = llm.chat(
        CHAT, SamplingParams(temperature=1.0, top_p=0.95, seed=8, max_tokens=24, ignore_eos=True)
    )
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_logprobs_come_back_for_every_token(llm: LLM) -> None:
    [out] = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    for token_id, lp in zip(completion.token_ids, completion.logprobs, strict=True):
        # Greedy picks a most likely token (bf16 logits can tie, so compare values).
        assert lp.token_id == token_id and len(lp.top) == 3
        assert lp.logprob == pytest.approx(lp.top[0][1])
    assert completion.cumulative_logprob == pytest.approx(
        sum(lp.logprob for lp in completion.logprobs)
    )


def test_bad_requests_are_refused_and_the_engine_keeps_serving(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="maximum context length is 256 tokens"):
        llm.generate("word " * 400, SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate({"prompt_token_ids": [10**9]}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="temperature"):
        llm.generate("hi", SamplingParams(temperature=-0.5))
    assert not llm.engine.has_unfinished_requests()
    [ok] = llm.generate("The capital of Italy is", SamplingParams(temperature=0, max_tokens=4))
    assert ok.outputs[0].token_ids


def test_an_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ModelNotFoundError):
        LLM("/nonexistent/path/model.gguf")


def test_async_engine_streams_deltas_serves_concurrently_and_aborts(llm: LLM) -> None:
    async def scenario() -> None:
        engine = AsyncLLM(llm.engine)
        engine.start()
        try:
            prompt = llm.get_tokenizer().render_chat(CHAT)
            params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

            async def collect(request_id: str) -> tuple[str, list[int], int]:
                text, ids, chunks = "", [], 0
                async for out in engine.generate(prompt, params, request_id):
                    text += out.outputs[0].text
                    ids += out.outputs[0].token_ids
                    chunks += 1
                return text, ids, chunks

            async def abandon() -> None:
                async for _ in engine.generate(
                    prompt, SamplingParams(max_tokens=200, ignore_eos=True), "gone"
                ):
                    break  # the consumer leaves after its first token

            first, second, _ = await asyncio.gather(collect("a"), collect("b"), abandon())
            assert first[1] == second[1] and len(first[1]) == 30 and first[2] > 1
            assert first[0] == llm.get_tokenizer().decode(first[1])
            for _ in range(100):  # the abort is applied between steps
                if engine.stats().num_running == 0:
                    break
                await asyncio.sleep(0.02)
            stats = engine.stats()
            assert stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate("", params, "empty"):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_a_failing_engine_fails_every_pending_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        engine = AsyncLLM(llm.engine)

        def broken_step() -> list[object]:
            raise RuntimeError("worker lost")

        monkeypatch.setattr(llm.engine, "step", broken_step)
        engine.start()
        with pytest.raises(EngineDeadError, match="worker lost"):
            async for _ in engine.generate("hello", SamplingParams(max_tokens=4), "doomed"):
                pass
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("hello", SamplingParams(max_tokens=4), "late"):
                pass
        await engine.shutdown()

    asyncio.run(scenario())
    llm.engine.abort_request(list(llm.engine.requests))


def cached_block_hashes(llm: LLM) -> set[bytes]:
    return {b.block_hash for b in llm.engine.scheduler.kv_cache.blocks if b.block_hash}


def test_cache_salts_never_share_cached_blocks_and_the_same_salt_does(llm: LLM) -> None:
    llm.engine.scheduler.kv_cache.reset_prefix_cache()
    text = "The tenant's secret system prompt says: " * 10
    prompt_ids = llm.get_tokenizer().encode(text)
    assert len(prompt_ids) > 64  # several full blocks of 16
    num_full_tokens = (len(prompt_ids) - 1) // 16 * 16
    params = SamplingParams(temperature=0, max_tokens=4)

    def run(salt: str | None) -> tuple[int, list[int], set[bytes]]:
        before = cached_block_hashes(llm)
        prompt: TokensPrompt = {"prompt_token_ids": prompt_ids}
        if salt is not None:
            prompt["cache_salt"] = salt
        [out] = llm.generate(prompt, params)
        return out.num_cached_tokens, out.outputs[0].token_ids, cached_block_hashes(llm) - before

    hit_a, tokens_a, new_a = run("tenant-a")
    hit_b, tokens_b, new_b = run("tenant-b")
    hit_none, tokens_none, new_none = run(None)
    assert (hit_a, hit_b, hit_none) == (0, 0, 0)
    # Each published its own blocks for the same tokens: three disjoint sets of hashes.
    assert len(new_a) == len(new_b) == len(new_none) >= num_full_tokens // 16
    assert not new_a & new_b and not new_a & new_none and not new_b & new_none
    assert tokens_a == tokens_b == tokens_none  # a salt changes what is cached, not the output
    assert run("tenant-a")[:2] == (num_full_tokens, tokens_a)
    assert run("tenant-b")[:2] == (num_full_tokens, tokens_a)
    [text_hit] = llm.generate({"prompt": text, "cache_salt": "tenant-a"}, params)
    assert text_hit.num_cached_tokens == num_full_tokens


def test_an_empty_cache_salt_is_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "cache_salt": ""})
