"""Weight-only int8: the quantized matmuls against the dequantized weight, the setting that
chooses them, and the real model run on them (forced here, where the CPU has AVX-512 BF16 and
`auto` keeps bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from real_model import KV_CACHE_GIB
from test_engine_vs_transformers import prompt_logits

from engine import LLM, SamplingParams
from engine import config as config_module
from engine.chat_template import ChatMessage
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.model.int8_weights import Int8Weight, linear, measure_max_gemv_tokens
from engine.model.parallel_layers import ColumnParallelLinear, VocabParallelEmbedding


def test_quantized_rows_are_within_half_a_step_of_the_weight() -> None:
    weight = torch.randn(96, 64) * torch.logspace(-3, 1, 96)[:, None]  # rows of every scale
    int8 = Int8Weight.quantize(weight, max_gemv_tokens=4)
    assert int8.qweight.dtype == torch.int8 and int8.qweight.abs().max() <= 127
    error = (int8.dequantized() - weight).abs()
    assert bool((error <= int8.scales[:, None] / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_matmul_paths_equal_the_dequantized_weight(dtype: torch.dtype) -> None:
    weight = torch.randn(80, 48, dtype=dtype)
    int8 = Int8Weight.quantize(weight, max_gemv_tokens=4)
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (0.1, 0.02)
    for num_tokens in (1, 4, 5, 33):  # the int8 kernel up to 4 tokens, dequantized above
        x = torch.randn(num_tokens, 48, dtype=dtype)
        expected = x.float() @ int8.dequantized().float().T
        torch.testing.assert_close(int8.linear(x).float(), expected, atol=atol, rtol=rtol)


def test_linear_adds_the_bias_and_rows_look_up_embeddings() -> None:
    weight, bias = torch.randn(32, 16), torch.randn(32)
    int8 = Int8Weight.quantize(weight, max_gemv_tokens=8)
    x = torch.randn(3, 16)
    torch.testing.assert_close(
        linear(x, weight, bias, int8), F.linear(x, int8.dequantized(), bias), atol=1e-4, rtol=1e-4
    )
    ids = torch.tensor([5, 0, 31])
    torch.testing.assert_close(int8.rows(ids), int8.dequantized()[ids])


def test_the_crossover_is_measured_within_the_probes() -> None:
    assert measure_max_gemv_tokens(64, 128, torch.float32) in (0, 1, 2, 4, 8, 16, 32, 64)


def test_quantization_setting_is_checked_and_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidRequestError, match="quantization must be one of"):
        EngineConfig("m", quantization="int4")
    with pytest.raises(InvalidRequestError, match="CPU only"):
        EngineConfig("m", quantization="int8", device="cuda")
    with pytest.raises(InvalidRequestError, match="q4_1 runs on CPU only"):
        EngineConfig("m", quantization="q4_1", device="cuda")
    monkeypatch.setattr(config_module, "_cpu_has_native_bf16", lambda: False)
    # auto: int8 where the model would otherwise read fp32.
    assert EngineConfig("m", device="cpu").weight_quantization() == "int8"
    assert EngineConfig("m", device="cpu", dtype="float32").weight_quantization() == "none"
    assert EngineConfig("m", device="cpu", quantization="none").weight_quantization() == "none"
    monkeypatch.setattr(config_module, "_cpu_has_native_bf16", lambda: True)
    assert EngineConfig("m", device="cpu").weight_quantization() == "none"
    assert EngineConfig("m", device="cpu", quantization="int8").weight_quantization() == "int8"
    assert EngineConfig("m", device="cpu", quantization="q4_1").weight_quantization() == "q4_1"


@pytest.mark.slow
def test_the_real_model_on_int8_weights_stays_close_to_full_precision(
    smollm2_gguf: Path,
) -> None:
    full, int8 = (
        LLM(str(smollm2_gguf), dtype="float32", quantization=quantization, max_model_len=512,
            cpu_kv_cache_gib=KV_CACHE_GIB)
        for quantization in ("none", "int8")
    )  # fmt: skip
    model = int8.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
    assert layers and all(m.quantized is not None and m.weight.numel() == 0 for m in layers)
    assert isinstance(model.embed_tokens, VocabParallelEmbedding)
    assert model.embed_tokens.int8 is not None  # the tied LM head too

    tokenizer = full.get_tokenizer()
    ids = tokenizer.encode(
        tokenizer.render_chat(
            [{"role": "user", "content": "Explain in one sentence why the sky is blue."}]
        )
    )
    ours, reference = prompt_logits(int8.engine, ids), prompt_logits(full.engine, ids)
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agreement >= 0.9, f"top-1 agrees at {agreement:.0%} of positions"
    assert (ours - reference).abs().max() < 0.3 * reference.abs().max()

    # Decoding runs the int8 kernel (few tokens a step) and says the same, greedy.
    question: list[ChatMessage] = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=16)
    [reply] = int8.chat(question, params)
    assert reply.outputs[0].text == "The capital of France is Paris."
