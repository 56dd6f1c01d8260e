"""Q4_1 weights kept as the GGUF's blocks (engine/model/q4_1_weights.py, the kernel in
engine/kernels/gemv_cpu.cpp): the kernel against gguf's own dequantizer and an fp32 matmul on
odd shapes and 1-16 tokens, with the kernels on and off; row-parallel shards on block
boundaries; the refusals; and the real model's greedy tokens against its dequantized twin."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine import LLM, SamplingParams
from engine.chat_template import ChatMessage
from engine.config import EngineConfig
from engine.distributed import TPGroup
from engine.errors import InvalidRequestError
from engine.kernels import cpu_kernels
from engine.loader import Checkpoint
from engine.model import q4_1_weights
from engine.model.parallel_layers import ColumnParallelLinear, RowParallelLinear
from engine.model.q4_1_weights import BLOCK_BYTES, Q4_1_GEMV_MAX_TOKENS, Q4_1Weight
from engine.outputs import CompletionOutput

# (N, K): one row; a partial group of four rows; the model's shapes; many short rows.
SHAPES = [(1, 32), (5, 96), (7, 64), (576, 576), (130, 1536), (2051, 32)]
TOKENS = [1, 2, 3, 4, 5, Q4_1_GEMV_MAX_TOKENS]


def random_blocks(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(n, k / 32 * 20) uint8 Q4_1 blocks with any nibbles and scales and mins of a real
    layer's size."""
    num_blocks = n * k // 32
    d = (torch.rand(num_blocks, 1, generator=gen) * 0.02).half()
    m = (-torch.rand(num_blocks, 1, generator=gen) * 0.1).half()
    nibbles = torch.randint(0, 256, (num_blocks, 16), generator=gen, dtype=torch.uint8)
    blocks = torch.cat((d.view(torch.uint8), m.view(torch.uint8), nibbles), dim=1)
    return blocks.reshape(n, k // 32 * BLOCK_BYTES)


def gguf_dequantized(blocks: torch.Tensor) -> torch.Tensor:
    """llama.cpp's reading of the blocks (gguf's numpy dequantizer), fp32 (N, K)."""
    values = dequantize(blocks.numpy(), GGMLQuantizationType.Q4_1)
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


def _close(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32 sums in another order; bf16 output adds one rounding (relative 2^-8).
    scale = expected.abs().max().item()
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours.float(), expected, atol=1e-4 * scale, rtol=rtol)


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_equals_the_gguf_dequantized_matmul(
    monkeypatch: pytest.MonkeyPatch,
    kernels_on: bool,
    n: int,
    k: int,
    num_tokens: int,
    dtype: torch.dtype,
) -> None:
    if kernels_on and cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built")
    if not kernels_on:
        monkeypatch.setattr(q4_1_weights, "cpu_kernels", lambda: None)
    gen = torch.Generator().manual_seed(n * k + num_tokens)
    weight = Q4_1Weight(random_blocks(n, k, gen), dtype)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    ours = weight.linear(x)
    assert ours.dtype == dtype and ours.shape == (num_tokens, n)
    reference = gguf_dequantized(weight.blocks)
    if not kernels_on and dtype == torch.bfloat16:
        reference = reference.to(dtype).float()  # the twin rounds the weight to bf16 first
    _close(ours, x.float() @ reference.T, dtype)


@pytest.mark.parametrize("kernels_on", [True, False])
def test_dequantized_is_gguf_s_reading_rounded_once(
    monkeypatch: pytest.MonkeyPatch, kernels_on: bool
) -> None:
    if kernels_on and cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built")
    if not kernels_on:
        monkeypatch.setattr(q4_1_weights, "cpu_kernels", lambda: None)
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(9, 160, gen)
    expected = gguf_dequantized(blocks)
    assert torch.equal(Q4_1Weight(blocks, torch.float32).dequantized(), expected)
    assert torch.equal(Q4_1Weight(blocks, torch.bfloat16).dequantized(), expected.bfloat16())


def test_steps_of_many_tokens_dequantize(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Recording:
        def q4_1_linear(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
            calls.append(f"kernel {x.shape[0]}")
            return torch.zeros(x.shape[0], blocks.shape[0])

        def q4_1_dequantize(self, blocks: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
            calls.append("dequantize")
            return torch.zeros(blocks.shape[0], k, dtype=dtype)

    monkeypatch.setattr(q4_1_weights, "cpu_kernels", lambda: Recording())
    weight = Q4_1Weight(random_blocks(8, 64, torch.Generator().manual_seed(1)), torch.float32)
    for num_tokens in (1, Q4_1_GEMV_MAX_TOKENS, Q4_1_GEMV_MAX_TOKENS + 1):
        weight.linear(torch.randn(num_tokens, 64))
    assert calls == ["kernel 1", f"kernel {Q4_1_GEMV_MAX_TOKENS}", "dequantize"]


def test_the_kernel_refuses_mismatched_inputs() -> None:
    kernels = cpu_kernels() or pytest.skip("the CPU kernels could not be built")
    blocks = torch.zeros(4, 2 * BLOCK_BYTES, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.q4_1_linear(torch.zeros(1, 48), blocks)
    with pytest.raises(RuntimeError, match="for x's K = 32"):
        kernels.q4_1_linear(torch.zeros(1, 32), blocks)
    with pytest.raises(RuntimeError, match="uint8 Q4_1 blocks"):
        kernels.q4_1_linear(torch.zeros(1, 64), blocks.float())


def test_row_parallel_shards_split_at_block_boundaries() -> None:
    """Two ranks' partial sums over their input columns add up to the whole matmul; a shard
    that would cut a block is refused."""
    gen = torch.Generator().manual_seed(2)
    full = random_blocks(6, 128, gen)
    x = torch.randn(2, 128, generator=gen)
    partials = []
    for rank in range(2):
        layer = RowParallelLinear(128, 6, _rank_of_two(rank))
        layer.quantized = Q4_1Weight.empty(6, 64, torch.float32)
        layer.load_q4_1(full)
        assert layer.quantized is not None
        partials.append(layer.quantized.linear(x[:, rank * 64 : (rank + 1) * 64]))
    expected = x @ gguf_dequantized(full).T
    torch.testing.assert_close(partials[0] + partials[1], expected, atol=1e-4, rtol=1e-5)

    layer = RowParallelLinear(96, 6, _rank_of_two(1))  # 48 columns a rank
    with pytest.raises(InvalidRequestError, match="not whole Q4_1 blocks"):
        layer.quantized = Q4_1Weight.empty(6, 48, torch.float32)
    with pytest.raises(InvalidRequestError, match="does not fall on Q4_1 blocks"):
        Q4_1Weight(random_blocks(6, 96, gen), torch.float32).columns(48, 96)


def test_column_parallel_parts_keep_their_rows() -> None:
    """Fused parts (as QKV, gate-up) each take their rank's rows of their own tensor."""
    gen = torch.Generator().manual_seed(3)
    gate, up = random_blocks(8, 64, gen), random_blocks(8, 64, gen)
    layer = ColumnParallelLinear(64, {"gate": 8, "up": 8}, bias=False, tp=_rank_of_two(1))
    layer.quantized = Q4_1Weight.empty(8, 64, torch.float32)
    layer.load_q4_1("gate", gate)
    layer.load_q4_1("up", up)
    assert torch.equal(layer.quantized.blocks, torch.cat((gate[4:], up[4:])))


def test_q4_1_is_refused_where_the_weights_are_not_q4_1(smollm2_checkpoint: Checkpoint) -> None:
    with pytest.raises(InvalidRequestError, match="q4_1 runs on CPU only"):
        EngineConfig("m", quantization="q4_1", device="cuda")
    # The tied embedding of the real GGUF is Q8_0.
    with pytest.raises(InvalidRequestError, match=r"token_embd\.weight is Q8_0"):
        list(smollm2_checkpoint.q4_1_blocks(lambda name: name == "model.embed_tokens.weight"))
    not_gguf = dataclasses.replace(smollm2_checkpoint, read_q4_1_blocks=None)
    with pytest.raises(InvalidRequestError, match="is not a GGUF file"):
        not_gguf.q4_1_blocks(lambda name: True)


def test_the_real_gguf_s_blocks_are_its_dequantized_weights(
    smollm2_checkpoint: Checkpoint,
) -> None:
    """Rows come back in Hugging Face order: Q and K rows un-permuted like the dequantized
    tensors."""
    names = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.mlp.down_proj.weight"}  # fmt: skip
    blocks = dict(smollm2_checkpoint.q4_1_blocks(names.__contains__))
    dense = dict(smollm2_checkpoint.tensors(names.__contains__))
    assert blocks.keys() == names
    for name in names:
        assert torch.equal(Q4_1Weight(blocks[name], torch.float32).dequantized(), dense[name])


def assert_same_greedy_up_to_a_near_tie(
    ours: CompletionOutput, reference: CompletionOutput, tolerance: float
) -> None:
    """The same greedy tokens with log-probabilities within `tolerance`, up to where the two
    part at a near tie: the reference ranks our token within `tolerance` of its own (bf16
    logits tie at one rounding step, 0.125 here). Past it the two texts differ, as they may."""
    assert ours.logprobs is not None and reference.logprobs is not None
    for a, b in zip(ours.logprobs, reference.logprobs, strict=False):
        assert a.logprob == pytest.approx(b.logprob, abs=tolerance)
        if a.token_id != b.token_id:
            ours_there = dict(b.top).get(a.token_id)
            assert ours_there is not None and b.logprob - ours_there <= tolerance, (a, b)
            return
    assert ours.token_ids == reference.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_real_model_on_q4_1_weights_decodes_as_the_dequantized_model(
    smollm2_gguf: Path, dtype: str
) -> None:
    """The same weights as the dequantized model, summed in another order (and, in bf16, not
    rounded to bf16 first): the same greedy tokens, log-probabilities close."""
    dequantized, q4_1 = (
        LLM(str(smollm2_gguf), dtype=dtype, quantization=quantization, max_model_len=256,
            enable_prefix_caching=False)
        for quantization in ("none", "q4_1")
    )  # fmt: skip
    model = q4_1.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert len(layers) == 4 * 30
    assert all(isinstance(m.quantized, Q4_1Weight) and m.weight.numel() == 0 for m in layers)

    questions: list[list[ChatMessage]] = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three primary colours."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    tolerance = 1e-3 if dtype == "float32" else 0.15
    for question in questions:
        [ours] = q4_1.chat(question, params)
        [reference] = dequantized.chat(question, params)
        assert_same_greedy_up_to_a_near_tie(ours.outputs[0], reference.outputs[0], tolerance)
    [reply] = q4_1.chat(questions[0], SamplingParams(temperature=0, max_tokens=16))
    assert reply.outputs[0].text == "The capital of France is Paris."


def _rank_of_two(rank: int) -> TPGroup:
    # Only the shard bounds are read: no process group, no collective.
    return TPGroup(rank=rank, size=2)


@pytest.mark.slow
def test_tensor_parallel_q4_1_on_the_real_model_equals_one_process(smollm2_gguf: Path) -> None:
    """TP 3 (SmolLM2's 9 heads): the ranks keep Q4_1 blocks in row-parallel shards of 192 and
    512 input columns (whole blocks), and their greedy tokens equal one process's."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    single = LLM(str(smollm2_gguf), dtype="float32", quantization="q4_1")
    tokenizer = single.get_tokenizer()
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "Hi there!"}]))
    [expected] = single.generate([{"prompt_token_ids": prompt}], params)
    single.shutdown()
    parallel = LLM(str(smollm2_gguf), dtype="float32", quantization="q4_1", tensor_parallel_size=3)
    try:
        model = parallel.engine.executor.runner.model
        [down] = [m for m in model.modules() if isinstance(m, RowParallelLinear)][1:2]
        assert isinstance(down.quantized, Q4_1Weight)  # layer 0's down_proj, after its o_proj
        assert down.quantized.in_features == 1536 // 3
        [ours] = parallel.generate([{"prompt_token_ids": prompt}], params)
        assert ours.outputs[0].token_ids == expected.outputs[0].token_ids
    finally:
        parallel.shutdown()
