"""The fused decode call (engine/model/fused_decode.py, engine/kernels/decode_layers_cpu.cpp)
against the layers run one module at a time: the same kernels in the same order, so the same
greedy tokens and the same log-probabilities to the bit, at one and several sequences a step; and
the steps and weights it leaves to the modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_model import KV_CACHE_GIB

from engine import LLM, SamplingParams
from engine.chat_template import ChatMessage
from engine.distributed import TPGroup
from engine.kernels import cpu_kernels
from engine.model import dense_matmul, fused_decode
from engine.model.attention import AttentionMetadata, PrefillChunk
from engine.model.dense_matmul import bf16_gemv_max_tokens
from engine.model.fused_decode import MAX_TOKENS, FusedDecode
from engine.model.int8_weights import Int8Weight
from engine.model.parallel_layers import ColumnParallelLinear
from engine.outputs import CompletionOutput

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels could not be built")

PROMPTS: list[list[ChatMessage]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Count from one to five."}],
    [{"role": "user", "content": "What is two plus two?"}],
    [{"role": "user", "content": "Name a large ocean."}],
    [{"role": "user", "content": "Spell the word cat."}],
]


def _decode(llm: LLM, num_prompts: int) -> list[CompletionOutput]:
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    return [out.outputs[0] for out in llm.chat(PROMPTS[:num_prompts], params)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "quantization"), [("bfloat16", "q4_1"), ("float32", "q4_1"), ("bfloat16", "none")]
)
def test_fused_decode_steps_equal_the_layers_one_by_one(
    monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path, dtype: str, quantization: str
) -> None:
    """Q4_1 blocks (bf16 and fp32) and dense bf16 weights: one sequence a step, then three, then
    six where every projection's kernel takes six (Q4_1: its range is 16, 32 on AMX tiles)."""
    llm = LLM(
        str(smollm2_gguf),
        dtype=dtype,
        quantization=quantization,
        max_model_len=256,
        cpu_kv_cache_gib=KV_CACHE_GIB,
        enable_prefix_caching=False,
    )
    try:
        runner = llm.engine.executor.runner
        fused = runner.fused_decode
        assert fused is not None
        step_sizes: list[int] = []
        run = FusedDecode.run

        def counted(self: FusedDecode, x: torch.Tensor, *args: object) -> object:
            step_sizes.append(x.shape[0])
            return run(self, x, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(FusedDecode, "run", counted)
        batches = [n for n in (1, 3, len(PROMPTS)) if n <= fused.max_tokens]
        for num_prompts in batches:
            runner.fused_decode = fused
            ours = _decode(llm, num_prompts)
            runner.fused_decode = None
            layers = _decode(llm, num_prompts)
            for a, b in zip(ours, layers, strict=True):
                assert a.token_ids == b.token_ids
                assert a.logprobs is not None and b.logprobs is not None
                assert [p.logprob for p in a.logprobs] == [p.logprob for p in b.logprobs]
        assert set(batches) <= set(step_sizes)
        assert quantization == "none" or len(PROMPTS) in batches
    finally:
        llm.shutdown()


def _meta(
    num_decodes: int, prefills: list[PrefillChunk], mask: torch.Tensor | None = None
) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.zeros(num_decodes, dtype=torch.long),
        num_decode_tokens=num_decodes,
        decode_block_tables=torch.zeros(num_decodes, 1, dtype=torch.long),
        decode_context_lens=torch.ones(num_decodes, dtype=torch.long),
        decode_mask=mask,
        prefills=prefills,
    )


def test_only_few_decodes_on_the_kernel_take_the_fused_call() -> None:
    fused = FusedDecode([], num_heads=9, eps=1e-5, scale=0.125, max_tokens=MAX_TOKENS)
    assert fused.can_run(1, _meta(1, []))
    assert fused.can_run(MAX_TOKENS, _meta(MAX_TOKENS, []))
    assert not fused.can_run(MAX_TOKENS + 1, _meta(MAX_TOKENS + 1, []))
    chunk = PrefillChunk(1, 4, 0, torch.zeros(1, dtype=torch.long), None)
    assert not fused.can_run(5, _meta(1, [chunk]))  # a prefill in the step
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    assert not fused.can_run(1, _meta(1, [], mask))  # the portable attention


def test_a_pinned_crossover_below_the_fused_range_narrows_it(
    monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path
) -> None:
    """MERIDIAN_MATMUL_CROSSOVER=2: the modules multiply a dense bf16 weight with F.linear from 3
    tokens, so the fused call takes steps of up to 2 only, and its bits stay the modules'. On a
    CPU whose flags leave the range to the pin (AVX-512 BF16 without AMX tiles), whatever this
    one has."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setenv("MERIDIAN_MATMUL_CROSSOVER", "2")
    dense_matmul.bf16_gemv_max_tokens.cache_clear()  # the suite's 16, kept per shape
    llm = LLM(str(smollm2_gguf), dtype="bfloat16", quantization="none", max_model_len=64,
              cpu_kv_cache_gib=KV_CACHE_GIB)  # fmt: skip
    try:
        fused = llm.engine.executor.runner.fused_decode
        assert fused is not None and fused.max_tokens == 2
    finally:
        llm.shutdown()
        dense_matmul.bf16_gemv_max_tokens.cache_clear()


def test_only_projections_our_kernels_multiply_are_fused() -> None:
    def layer(dtype: torch.dtype, bias: bool = False) -> ColumnParallelLinear:
        return ColumnParallelLinear(64, {"a": 32}, bias, TPGroup()).to(dtype)

    bf16 = layer(torch.bfloat16)
    kernel_weight = fused_decode._kernel_weight(bf16)
    assert kernel_weight is not None
    assert kernel_weight[0] is bf16.weight and kernel_weight[1] == bf16_gemv_max_tokens(32, 64)
    assert fused_decode._kernel_weight(layer(torch.float32)) is None  # F.linear / oneDNN
    assert fused_decode._kernel_weight(layer(torch.bfloat16, bias=True)) is None
    int8 = layer(torch.bfloat16)
    int8.quantized = Int8Weight.quantize(int8.weight.data, max_gemv_tokens=4)
    assert fused_decode._kernel_weight(int8) is None
