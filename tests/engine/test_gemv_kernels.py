"""The bf16 GEMV kernel (engine/kernels/gemv_cpu.cpp) against fp32 matmuls of the same
weights, on odd shapes (row counts that leave a partial group of four, K that leaves a partial
vector, several threads' worth of rows) and 1-64 tokens (partial tiles of four tokens); and the
layers' `linear` choosing it or its PyTorch twin; and the real model's bf16 decode through
both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_model import KV_CACHE_GIB

from engine import LLM, SamplingParams
from engine.chat_template import ChatMessage
from engine.kernels import cpu_kernels
from engine.model import dense_matmul
from engine.model.dense_matmul import bf16_gemv_max_tokens
from engine.model.int8_weights import Int8Weight, linear
from engine.outputs import CompletionOutput

kernels = cpu_kernels() or pytest.skip(
    "the CPU kernels could not be built", allow_module_level=True
)

# (N, K, tokens), each shape with the token counts that take its other paths, rather than every
# pair: the kernel runs rows in groups of 4 (a last partial group row by row), K in vectors (a
# last partial one masked) and tokens in tiles of 1-4. Together: every tile size with full and
# partial row groups and vectors, and weights split over threads.
CASES = [
    (1, 1, 1),  # one row, K under one vector
    (5, 17, 2),  # a group of 4 and a single row, a partial vector, a tile of 2
    (5, 17, 13),  # tiles 4, 4, 4, 1
    (7, 33, 3),  # three single rows, a tile of 3
    (7, 33, 8),  # two full tiles
    (576, 576, 1),  # the model's shape, over threads
    (576, 576, 64),  # many tiles
    (130, 1536, 13),  # over threads, with a partial group
    (2051, 100, 3),  # many rows, a partial vector
]


def _bf16_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    # Both round an fp32 sum once to bf16; the sums differ in order only, so at most the last
    # bf16 bit of a result moves (relative 2^-8), and results near zero by the fp32 noise.
    scale = expected.abs().max().item()
    torch.testing.assert_close(ours.float(), expected, atol=1e-4 * scale, rtol=2**-7)


@pytest.mark.parametrize(("n", "k", "num_tokens"), CASES)
def test_bf16_linear_equals_the_fp32_matmul(n: int, k: int, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(n + k * num_tokens)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, k, generator=gen).to(torch.bfloat16)
    ours = kernels.bf16_linear(x, weight)
    assert ours.dtype == torch.bfloat16 and ours.shape == (num_tokens, n)
    _bf16_close(ours, x.float() @ weight.float().T)


def test_the_kernel_refuses_mismatched_inputs() -> None:
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="K = 16"):
        kernels.bf16_linear(x, torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 x and weight"):
        kernels.bf16_linear(x.float(), torch.zeros(4, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous x"):
        kernels.bf16_linear(x.T, torch.zeros(4, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 4, 5, 9, 65])
def test_linear_gives_the_same_result_with_kernels_on_and_off(
    monkeypatch: pytest.MonkeyPatch, kernels_on: bool, num_tokens: int
) -> None:
    """bf16 weights: up to bf16_gemv_max_tokens(N, K) through our kernel (on) or F.linear
    (off), above it through F.linear. int8 weights: int8pack up to max_gemv_tokens, then the
    dequantized matmul, with the kernels on or off."""
    if not kernels_on:
        monkeypatch.setattr(dense_matmul, "_kernels_for", lambda x: None)
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(70, 48, generator=gen).to(torch.bfloat16)
    bias = torch.randn(70, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 48, generator=gen).to(torch.bfloat16)
    int8 = Int8Weight.quantize(weight, max_gemv_tokens=8)
    # Above max_gemv_tokens (8) the weight is dequantized to bf16 first, rounding each element.
    dequantized = (
        int8.dequantized().float()
        if num_tokens > 8
        else int8.qweight.float() * int8.scales.float()[:, None]
    )
    _bf16_close(linear(x, weight, None, int8), x.float() @ dequantized.T)
    # The kernel's path rounds x W^T to bf16 before adding the bias: half an ulp of x W^T more.
    product = x.float() @ weight.float().T
    rounding = 2**-8 * product.abs().max().item()
    torch.testing.assert_close(
        linear(x, weight, bias, None).float(), product + bias.float(), atol=rounding, rtol=2**-7
    )


@pytest.mark.usefixtures("few_probe_copies")
def test_linear_takes_the_kernel_for_few_bf16_tokens_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    class Recording:
        def bf16_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return kernels.bf16_linear(x, weight)

    monkeypatch.setattr(dense_matmul, "_kernels_for", lambda x: Recording())
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    most = bf16_gemv_max_tokens(8, 16)
    for num_tokens in (1, most, most + 1):
        linear(torch.randn(num_tokens, 16, dtype=torch.bfloat16), weight, None, None)
    linear(torch.randn(1, 16), weight.float(), None, None)  # fp32: F.linear
    assert calls == [1, most]


@pytest.mark.slow
def test_the_real_model_decodes_the_same_with_the_kernel_and_with_f_linear(
    monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path
) -> None:
    """bf16 steps through the kernel (every decode step, and the prompt's prefill where it is
    within the kernel's tokens) and through F.linear, against the fp32 model: the same greedy
    tokens, each bf16 run's log-probabilities within bf16's noise of fp32's (sums in another
    order, rounded to bf16 at every layer, over 30 layers: on six prompts F.linear's parted
    from fp32's by at most 0.03-0.14, the kernel's by 0.08-0.20)."""
    question: list[ChatMessage] = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1)

    def answer(dtype: str) -> CompletionOutput:
        llm = LLM(
            str(smollm2_gguf),
            dtype=dtype,
            max_model_len=256,
            cpu_kv_cache_gib=KV_CACHE_GIB,
            enable_prefix_caching=False,
        )
        [output] = llm.chat(question, params)
        return output.outputs[0]

    fp32 = answer("float32")
    kernel = answer("bfloat16")
    monkeypatch.setattr(dense_matmul, "_kernels_for", lambda x: None)
    f_linear = answer("bfloat16")
    assert kernel.text == "The capital of France is Paris."
    assert kernel.token_ids == f_linear.token_ids == fp32.token_ids
    for bf16 in (kernel, f_linear):
        assert bf16.logprobs is not None and fp32.logprobs is not None
        for a, b in zip(bf16.logprobs, fp32.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=0.25)
