"""Our engine against Hugging Face transformers, the reference: logits, and greedy outputs
through continuous batching, chunked prefill, preemption and the prefix cache."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from real_model import KV_CACHE_GIB
from tiny_checkpoints import save_tiny_transformers_model

from bench.kv_cache_accuracy import prompt_logits
from engine import LLM, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves falling in a quiet park at dusk.",
    "How many legs does a spider have?",
    "Explain in one sentence why the sky is blue, mentioning Rayleigh scattering and the sun.",
    "Translate 'good morning' into Spanish.",
    "List the first five prime numbers.",
    "What does a bee make?",
]


def hf_greedy(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    # A small token budget, so prompts are prefilled in several chunks beside decodes (also the
    # first step's: no larger budget for steps without decodes).
    return LLM(
        str(smollm2_gguf),
        dtype="float32",
        cpu_kv_cache_gib=KV_CACHE_GIB,
        max_num_batched_tokens=48,
        max_num_prefill_only_tokens=None,
    )


@pytest.fixture(scope="module")
def chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": q}])) for q in QUESTIONS
    ]


def test_prompt_logits_equal_transformers(
    llm: LLM, chat_prompts: list[list[int]], hf_smollm2_model: PreTrainedModel
) -> None:
    for ids in chat_prompts[:3]:
        ours = prompt_logits(llm.engine, ids)
        with torch.inference_mode():
            theirs = hf_smollm2_model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_known_greedy_reply(llm: LLM) -> None:
    [out] = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
    )
    assert out.outputs[0].token_ids == [504, 3575, 282, 4649, 314, 7042, 30, 2]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_concurrent_greedy_equals_alone_and_transformers(
    llm: LLM, chat_prompts: list[list[int]], hf_smollm2_model: PreTrainedModel
) -> None:
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i) for i in range(len(QUESTIONS))]
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts]
    together = llm.generate(prompts, params)
    for i, prompt in enumerate(prompts):
        [alone] = llm.generate(prompt, params[i])
        assert together[i].outputs[0].token_ids == alone.outputs[0].token_ids, QUESTIONS[i]
    for i in (0, 2, 4):
        expected = hf_greedy(hf_smollm2_model, chat_prompts[i], params[i].max_tokens or 0)
        assert together[i].outputs[0].token_ids == expected, QUESTIONS[i]


def test_decode_logprobs_equal_transformers(
    llm: LLM, chat_prompts: list[list[int]], hf_smollm2_model: PreTrainedModel
) -> None:
    """Each decoded token's top-5 log-probabilities equal the reference's at that position:
    this checks the decode path (paged reads across blocks), not just the prefill."""
    ids = chat_prompts[4]
    [out] = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    )
    generated = out.outputs[0].token_ids
    with torch.inference_mode():
        logits = hf_smollm2_model(torch.tensor([ids + generated])).logits[0].float()
    reference = logits.log_softmax(-1)[len(ids) - 1 : -1]
    assert out.outputs[0].logprobs is not None
    for step, token_logprobs in enumerate(out.outputs[0].logprobs):
        top_values, top_ids = reference[step].topk(5)
        assert [t for t, _ in token_logprobs.top] == top_ids.tolist()
        ours = torch.tensor([v for _, v in token_logprobs.top])
        torch.testing.assert_close(ours, top_values, atol=2e-4, rtol=1e-4)
        assert token_logprobs.logprob == pytest.approx(float(top_values[0]), abs=2e-4)


def test_preemption_under_a_tiny_pool_changes_no_output(
    smollm2_gguf: Path, llm: LLM, chat_prompts: list[list[int]]
) -> None:
    # 10 blocks of 16 tokens cannot hold eight ~40-token prompts and their outputs at once.
    tiny = LLM(str(smollm2_gguf), dtype="float32", num_kv_blocks=10, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts]
    squeezed = tiny.generate(prompts, params)
    assert tiny.engine.stats().num_preemptions_total > 0
    roomy = llm.generate(prompts, params)
    for a, b in zip(squeezed, roomy, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = tiny.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "every block returns to the pool"


def test_prefix_cache_hits_change_no_output(llm: LLM, smollm2_gguf: Path) -> None:
    """One by one, each request finds the system prompt's blocks an earlier one cached; in one
    burst with a cold system prompt, the others read the blocks the first fills in that very
    step (engine/scheduler.py). Neither changes a token against an engine without the cache."""
    tokenizer = llm.get_tokenizer()

    def with_system(system: str) -> list[str]:
        return [
            tokenizer.render_chat(
                [{"role": "system", "content": system}, {"role": "user", "content": q}]
            )
            for q in QUESTIONS[:4]
        ]

    prompts = with_system("You are a meticulous assistant. " * 12)
    burst_prompts = with_system("Answer as a ship's captain writing the day's log. " * 8)
    params = SamplingParams(temperature=0, max_tokens=12)
    before = llm.engine.stats().prefix_cache_hit_tokens
    cached = [llm.generate(p, params)[0] for p in prompts]
    assert llm.engine.stats().prefix_cache_hit_tokens - before >= 3 * 64
    assert all(o.num_cached_tokens >= 64 for o in cached[1:])
    burst = llm.generate(burst_prompts, params)
    assert burst[0].num_cached_tokens == 0 and all(o.num_cached_tokens >= 64 for o in burst[1:])
    uncached_llm = LLM(
        str(smollm2_gguf),
        dtype="float32",
        cpu_kv_cache_gib=KV_CACHE_GIB,
        enable_prefix_caching=False,
    )
    uncached = uncached_llm.generate(prompts + burst_prompts, params)
    assert uncached_llm.engine.stats().prefix_cache_hit_tokens == 0
    for a, b in zip(cached + burst, uncached, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_special_tokens_in_text_match_the_reference_tokenizer(
    llm: LLM, hf_smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ours = llm.get_tokenizer().encode(text)
    assert ours == hf_smollm2_tokenizer.encode(text, add_special_tokens=True)
    assert ours[0] == 1, "no extra BOS: the prompt's own <|im_start|> comes first"


# Llama 3.1's RoPE scaling, with a pretraining context short enough (32 of 128 positions) that
# the tiny model's head_dim of 16 has frequencies kept, blended and slowed.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
# (family, config overrides): every model shape the engine claims, as tiny random checkpoints.
TINY_MODELS = {
    "llama": ("llama", {}),
    "llama3.1-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "qwen2-tied": ("qwen2", {}),
    # Qwen2.5 7B and up: QKV biases, an untied LM head, theta 1e6.
    "qwen2.5-untied": ("qwen2", {"tie_word_embeddings": False, "rope_theta": 1e6}),
}


@pytest.mark.parametrize("name", TINY_MODELS)
def test_random_checkpoint_logits_and_greedy_equal_transformers(tmp_path: Path, name: str) -> None:
    family, overrides = TINY_MODELS[name]
    reference = save_tiny_transformers_model(tmp_path, family, **overrides)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32)
    ids = torch.randint(3, 94, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prompt_logits(llm.engine, ids)
    with torch.inference_mode():
        theirs = reference(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # Greedy decoding runs the decode path, past the 32 positions of LLAMA3_ROPE's context.
    [out] = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    with torch.inference_mode():
        generated = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert out.outputs[0].token_ids == generated[0, len(ids) :].tolist()
