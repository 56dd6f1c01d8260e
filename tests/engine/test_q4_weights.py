"""Block weights kept as the GGUF's blocks (engine/model/block_weights.py, the kernels in
engine/kernels/gemv_cpu.cpp): the Q4_1 and Q8_0 kernels against gguf's own dequantizer and an
fp32 matmul on odd shapes and 1-16 tokens, with the kernels on and off; the fp16 scales widened
exactly; row-parallel shards on block boundaries; the Q8_0 LM head's vocabulary shards; the
refusals; and the real model's greedy tokens against its dequantized twin."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from real_model import KV_CACHE_GIB

from engine import LLM, SamplingParams
from engine import config as config_module
from engine.chat_template import ChatMessage
from engine.config import EngineConfig
from engine.distributed import TPGroup
from engine.errors import InvalidRequestError
from engine.kernels import cpu_kernels
from engine.loader import Checkpoint
from engine.model import block_weights
from engine.model.block_weights import (
    AMX_BLOCKS_MAX_TOKENS,
    GEMV_MAX_TOKENS,
    HEAD_BLOCKS_MAX_TOKENS,
    Q4_1,
    Q8_0,
    BlockFormat,
    BlockWeight,
)
from engine.model.dense_matmul import dense_linear, packs_bf16
from engine.model.llama import keeps_q4_1_blocks
from engine.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.outputs import CompletionOutput

# (N, K, tokens), each shape with the token counts that take its other paths, rather than every
# pair: the kernel runs rows in groups of 4 (a last partial group row by row) and tokens in tiles
# of 1-4 (over 4 in bf16 on AVX-512 BF16: rows dequantized in L1), and over GEMV_MAX_TOKENS (or
# bf16's own limit) the dense path. Together: every tile size with full and partial row groups,
# one block and many per row, a weight split over threads, and both sides of the token limit.
CASES = [
    (1, 32, 1),  # one row, one block
    (5, 96, 2),  # a group of 4 and a single row, a tile of 2
    (5, 96, 5),  # tiles of 4 and 1 (bf16: the rows dequantized in L1)
    (7, 64, 3),  # three single rows, a tile of 3
    (7, 64, 13),  # tiles 4, 4, 4, 1
    (576, 576, 4),  # the model's shape, over threads: one full tile
    (576, 576, GEMV_MAX_TOKENS),  # the last step in the kernel's range
    (130, 1536, 1),  # over threads, with a partial group
    (130, 1536, 64),  # past the range: the dense path (bf16 may keep the kernel)
    (2051, 32, 5),  # many short rows, a partial group of 3
]
FORMATS = [Q4_1, Q8_0]


def random_blocks(n: int, k: int, gen: torch.Generator, fmt: BlockFormat = Q4_1) -> torch.Tensor:
    """(n, k / 32 * file bytes) uint8 blocks as a GGUF stores them: any quants, scales (and
    mins) of a real layer's size."""
    num_blocks = n * k // 32
    d = (torch.rand(num_blocks, 1, generator=gen) * 0.02).half()
    parts = [d.view(torch.uint8)]
    if fmt is Q4_1:
        parts.append((-torch.rand(num_blocks, 1, generator=gen) * 0.1).half().view(torch.uint8))
    quants = torch.randint(0, 256, (num_blocks, fmt.num_quant_bytes), generator=gen)
    parts.append(quants.to(torch.uint8))
    return torch.cat(parts, dim=1).reshape(n, k // 32 * fmt.file_block_bytes)


def gguf_dequantized(file_blocks: torch.Tensor, fmt: BlockFormat = Q4_1) -> torch.Tensor:
    """llama.cpp's reading of the blocks (gguf's numpy dequantizer), fp32 (N, K)."""
    values = dequantize(file_blocks.numpy(), GGMLQuantizationType[fmt.gguf_type])
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


def _close(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32 sums in another order; bf16 output adds one rounding (relative 2^-8).
    scale = expected.abs().max().item()
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours.float(), expected, atol=1e-4 * scale, rtol=rtol)


@pytest.mark.usefixtures("few_probe_copies")
@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize(("n", "k", "num_tokens"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_linear_equals_the_gguf_dequantized_matmul(
    monkeypatch: pytest.MonkeyPatch,
    kernels_on: bool,
    n: int,
    k: int,
    num_tokens: int,
    dtype: torch.dtype,
    fmt: BlockFormat,
) -> None:
    if kernels_on and cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built")
    if not kernels_on:
        monkeypatch.setattr(block_weights, "cpu_kernels", lambda: None)
    gen = torch.Generator().manual_seed(n * k + num_tokens)
    file_blocks = random_blocks(n, k, gen, fmt)
    weight = BlockWeight.from_gguf(file_blocks, fmt, dtype)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    ours = weight.linear(x)
    assert ours.dtype == dtype and ours.shape == (num_tokens, n)
    reference = gguf_dequantized(file_blocks, fmt)
    if dtype == torch.bfloat16 and (not kernels_on or _has_avx512_bf16()):
        # The twin, and the kernel's AVX-512 BF16 loop, round each weight to bf16 first.
        reference = reference.to(dtype).float()
    _close(ours, x.float() @ reference.T, dtype)


def _has_avx512_bf16() -> bool:
    flags = next(
        ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
    )
    return "avx512_bf16" in flags.split()


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantized_is_gguf_s_reading_rounded_once(
    monkeypatch: pytest.MonkeyPatch, kernels_on: bool, fmt: BlockFormat
) -> None:
    if kernels_on and cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built")
    if not kernels_on:
        monkeypatch.setattr(block_weights, "cpu_kernels", lambda: None)
    file_blocks = random_blocks(9, 160, torch.Generator().manual_seed(0), fmt)
    expected = gguf_dequantized(file_blocks, fmt)
    for dtype in (torch.float32, torch.bfloat16):
        weight = BlockWeight.from_gguf(file_blocks, fmt, dtype)
        assert torch.equal(weight.dequantized(), expected.to(dtype))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_widened_scales_are_the_file_s_exactly(fmt: BlockFormat) -> None:
    """Every fp16 scale (subnormals, infinities and the largest included) is its fp32 value;
    the quants are the file's bytes."""
    every_fp16 = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    num_blocks = every_fp16.numel() // fmt.num_scales
    scales = every_fp16[: num_blocks * fmt.num_scales].reshape(num_blocks, fmt.num_scales)
    quants = torch.randint(0, 256, (num_blocks, fmt.num_quant_bytes), dtype=torch.uint8)
    file_blocks = torch.cat((scales.contiguous().view(torch.uint8), quants), dim=1)
    blocks = block_weights.widen_scales(file_blocks.reshape(1, -1), fmt).view(num_blocks, -1)
    widened = blocks[:, : 4 * fmt.num_scales].contiguous().view(torch.float32)
    torch.testing.assert_close(widened, scales.float(), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(blocks[:, 4 * fmt.num_scales :], quants)


def test_steps_of_many_tokens_dequantize(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Recording:
        def q4_1_linear(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
            calls.append(f"kernel {x.shape[0]}")
            return torch.zeros(x.shape[0], blocks.shape[0])

        def q4_1_dequantize(self, blocks: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
            calls.append("dequantize")
            return torch.zeros(blocks.shape[0], k, dtype=dtype)

    monkeypatch.setattr(block_weights, "cpu_kernels", lambda: Recording())
    file_blocks = random_blocks(8, 64, torch.Generator().manual_seed(1))
    weight = BlockWeight.from_gguf(file_blocks, Q4_1, torch.float32)
    for num_tokens in (1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1):
        weight.linear(torch.randn(num_tokens, 64))
    assert calls == ["kernel 1", f"kernel {GEMV_MAX_TOKENS}", "dequantize"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_steps_on_the_cpu_dequantize_the_layer_once(dtype: torch.dtype) -> None:
    # A prefill step of many tokens (a cached prefix's last block and question, a batch of
    # prompts) multiplies the dequantized weight kept from the first such step (bf16: in
    # oneDNN's layout, where torch has oneDNN), the same bits every step.
    file_blocks = random_blocks(8, 64, torch.Generator().manual_seed(2))
    weight = BlockWeight.from_gguf(file_blocks, Q4_1, dtype)
    x = torch.randn(GEMV_MAX_TOKENS + 9, 64, dtype=dtype)
    expected = torch.nn.functional.linear(x, weight.dequantized())
    first = weight.linear(x)
    kept = weight.dense_for(x)
    assert kept.is_mkldnn == (dtype == torch.bfloat16 and packs_bf16())
    assert torch.equal(weight.linear(x), first)
    torch.testing.assert_close(first, expected)
    assert weight.dense_for(x) is kept


def test_the_kernel_refuses_mismatched_inputs() -> None:
    kernels = cpu_kernels() or pytest.skip("the CPU kernels could not be built")
    blocks = torch.zeros(4, 2 * Q4_1.block_bytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.q4_1_linear(torch.zeros(1, 48), blocks)
    with pytest.raises(RuntimeError, match=r"uint8 Q4_1 blocks \(N, 24\) for K = 32"):
        kernels.q4_1_linear(torch.zeros(1, 32), blocks)
    with pytest.raises(RuntimeError, match="uint8 Q4_1 blocks"):
        kernels.q4_1_linear(torch.zeros(1, 64), blocks.float())
    with pytest.raises(RuntimeError, match=r"uint8 Q8_0 blocks \(N, 72\) for K = 64"):
        kernels.q8_0_linear(torch.zeros(1, 64), blocks)


def test_row_parallel_shards_split_at_block_boundaries() -> None:
    """Two ranks' partial sums over their input columns add up to the whole matmul; a shard
    that would cut a block is refused."""
    gen = torch.Generator().manual_seed(2)
    full = random_blocks(6, 128, gen)
    x = torch.randn(2, 128, generator=gen)
    partials = []
    for rank in range(2):
        layer = RowParallelLinear(128, 6, _rank_of_two(rank))
        layer.quantized = BlockWeight.empty(Q4_1, 6, 64, torch.float32)
        layer.load_blocks(BlockWeight.from_gguf(full, Q4_1, torch.float32))
        assert layer.quantized is not None
        partials.append(layer.quantized.linear(x[:, rank * 64 : (rank + 1) * 64]))
    expected = x @ gguf_dequantized(full).T
    torch.testing.assert_close(partials[0] + partials[1], expected, atol=1e-4, rtol=1e-5)

    layer = RowParallelLinear(96, 6, _rank_of_two(1))  # 48 columns a rank
    with pytest.raises(InvalidRequestError, match="not whole blocks"):
        layer.quantized = BlockWeight.empty(Q4_1, 6, 48, torch.float32)
    with pytest.raises(InvalidRequestError, match="does not fall on blocks"):
        BlockWeight.from_gguf(random_blocks(6, 96, gen), Q4_1, torch.float32).columns(48, 96)


def test_column_parallel_parts_keep_their_rows() -> None:
    """Fused parts (as QKV, gate-up) each take their rank's rows of their own tensor."""
    gen = torch.Generator().manual_seed(3)
    gate, up = random_blocks(8, 64, gen), random_blocks(8, 64, gen)
    layer = ColumnParallelLinear(64, {"gate": 8, "up": 8}, bias=False, tp=_rank_of_two(1))
    layer.quantized = BlockWeight.empty(Q4_1, 8, 64, torch.float32)
    layer.load_blocks("gate", BlockWeight.from_gguf(gate, Q4_1, torch.float32))
    layer.load_blocks("up", BlockWeight.from_gguf(up, Q4_1, torch.float32))
    expected = block_weights.widen_scales(torch.cat((gate[4:], up[4:])), Q4_1)
    assert torch.equal(layer.quantized.blocks, expected)


def test_the_q8_0_head_keeps_each_rank_s_vocabulary_rows() -> None:
    """Two ranks' shards of an odd vocabulary: each rank's rows of the file's blocks, the last
    shard padded with zero blocks (zero weights, as the float shard's zero rows)."""
    gen = torch.Generator().manual_seed(4)
    vocab, hidden = 37, 96
    full = random_blocks(vocab, hidden, gen, Q8_0)
    dense = gguf_dequantized(full, Q8_0)
    for rank in range(2):
        head = VocabParallelEmbedding(vocab, hidden, _rank_of_two(rank))
        head.load(dense)
        head.keep_head_blocks(full, Q8_0)
        assert head.head_blocks is not None
        assert torch.equal(head.head_blocks.dequantized(), head.weight.data)


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_q8_0_head_s_logits_read_the_blocks_for_few_tokens(
    monkeypatch: pytest.MonkeyPatch, kernels_on: bool, dtype: torch.dtype
) -> None:
    """Steps of few tokens multiply by the blocks (where the kernels built), bigger steps and
    every step without kernels by the float rows; both are the file's weights times x."""
    if kernels_on and cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built")
    if not kernels_on:
        monkeypatch.setattr(block_weights, "cpu_kernels", lambda: None)
    gen = torch.Generator().manual_seed(5)
    vocab, hidden = 203, 160
    full = random_blocks(vocab, hidden, gen, Q8_0)
    dense = gguf_dequantized(full, Q8_0)
    head = VocabParallelEmbedding(vocab, hidden, TPGroup()).to(dtype)
    head.load(dense)
    head.keep_head_blocks(full, Q8_0)
    assert head.head_blocks is not None
    for num_tokens in (1, 3, 8, 9, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1):
        x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
        logits = head.logits(x)
        assert logits.dtype == torch.float32 and logits.shape == (num_tokens, vocab)
        reads_blocks = kernels_on and num_tokens <= head.head_blocks.max_kernel_tokens()
        expected = head.head_blocks.linear(x) if reads_blocks else dense_linear(x, head.head_rows())
        assert torch.equal(logits, expected.float())
        # Where oneDNN multiplies bf16, the rows the dense steps read are packed for it.
        assert head.head_rows().is_mkldnn == (dtype == torch.bfloat16 and packs_bf16())
        # The float rows are the weights rounded to the dtype, as the blocks' bf16 loop rounds.
        rounded = not reads_blocks or _has_avx512_bf16()
        weights = dense.to(dtype).float() if rounded else dense
        _close(logits, x.float() @ weights.T, dtype)


@pytest.mark.parametrize(
    ("dtype", "float_rows_kept", "amx", "expected"),
    [
        # Without AMX, the packed dense weight takes the steps over 16 tokens, bf16 or fp32.
        (torch.bfloat16, False, False, GEMV_MAX_TOKENS),
        (torch.float32, False, False, GEMV_MAX_TOKENS),
        (torch.float32, False, True, GEMV_MAX_TOKENS),  # no AMX tiles multiply fp32
        # The LM head: its packed float rows beat its blocks over 4 tokens; in fp32 the blocks
        # keep their range.
        (torch.bfloat16, True, False, HEAD_BLOCKS_MAX_TOKENS),
        (torch.float32, True, False, GEMV_MAX_TOKENS),
        # AMX: the blocks on the tiles up to 32 tokens, the head's too.
        (torch.bfloat16, False, True, AMX_BLOCKS_MAX_TOKENS),
        (torch.bfloat16, True, True, AMX_BLOCKS_MAX_TOKENS),
    ],
)
def test_blocks_are_read_where_they_beat_the_dense_weight(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    float_rows_kept: bool,
    amx: bool,
    expected: int,
) -> None:
    calls: list[str] = []

    class Recording:
        def amx_tiles_ready(self) -> bool:
            return amx

        def q4_1_linear(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
            calls.append("kernel")
            return torch.zeros(x.shape[0], blocks.shape[0], dtype=x.dtype)

        def q4_1_dequantize(self, blocks: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
            calls.append("dequantize")
            return torch.zeros(blocks.shape[0], k, dtype=dtype)

    monkeypatch.setattr(block_weights, "cpu_kernels", lambda: Recording())
    monkeypatch.setattr(block_weights, "dense_linear", lambda x, w: x @ w.T)
    monkeypatch.setattr(block_weights, "packed", lambda w: w)
    weight = dataclasses.replace(
        BlockWeight.from_gguf(random_blocks(8, 64, torch.Generator().manual_seed(2)), Q4_1, dtype),
        float_rows_kept=float_rows_kept,
    )
    assert weight.max_kernel_tokens() == expected
    for num_tokens in (expected, expected + 1):
        weight.linear(torch.randn(num_tokens, 64).to(dtype))
    assert calls == ["kernel", "dequantize"]


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the bf16 loops need AVX-512 BF16")
@pytest.mark.parametrize("num_tokens", [1, 4, 5, 13, 64])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_bf16_blocks_give_the_dequantized_weight_s_bits(num_tokens: int, fmt: BlockFormat) -> None:
    """Up to 4 tokens the blocks' loop forms each block's weights in registers, over 4 it
    dequantizes a group of rows in L1 for the dense loop; either way the products and their
    order are the dense kernel's on the dequantized weight, to the bit."""
    kernels = cpu_kernels() or pytest.skip("the CPU kernels could not be built")
    if num_tokens >= 2 and kernels.amx_tiles_ready():
        pytest.skip("on AMX tiles: test_amx_tiles_sum_the_dequantized_weight_s_products")
    gen = torch.Generator().manual_seed(num_tokens)
    weight = BlockWeight.from_gguf(random_blocks(130, 1536, gen, fmt), fmt, torch.bfloat16)
    x = torch.randn(num_tokens, 1536, generator=gen).to(torch.bfloat16)
    ours = getattr(kernels, f"{fmt.name}_linear")(x, weight.blocks)
    assert torch.equal(ours, kernels.bf16_linear(x, weight.dequantized()))


@pytest.mark.parametrize("num_tokens", [2, 13, 16, 17, 32, 33])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_amx_tiles_sum_the_dequantized_weight_s_products(num_tokens: int, fmt: BlockFormat) -> None:
    """On AMX tiles the products are the dequantized weight's (bf16 times bf16, exact in fp32)
    and only their sums' order differs: every output within one bf16 rounding of the exact sum,
    nearly all the same bits. Token counts on both sides of a tile (16) and of a pass (32); a
    last partial group of rows (130 = 4 groups of 32 and 2)."""
    kernels = cpu_kernels() or pytest.skip("the CPU kernels could not be built")
    if not kernels.amx_tiles_ready():
        pytest.skip("no AMX tiles on this CPU (or the OS did not grant them)")
    gen = torch.Generator().manual_seed(num_tokens)
    weight = BlockWeight.from_gguf(random_blocks(130, 1536, gen, fmt), fmt, torch.bfloat16)
    x = torch.randn(num_tokens, 1536, generator=gen).to(torch.bfloat16)
    ours = getattr(kernels, f"{fmt.name}_linear")(x, weight.blocks)
    exact = x.float() @ weight.dequantized().float().T
    assert ours.shape == exact.shape
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
    assert ((ours.float() - exact).abs() <= ulp + 1e-6).all()
    assert (ours == exact.to(torch.bfloat16)).float().mean() > 0.99


def test_q4_1_is_refused_where_the_weights_are_not_q4_1(smollm2_checkpoint: Checkpoint) -> None:
    with pytest.raises(InvalidRequestError, match="q4_1 runs on CPU only"):
        EngineConfig("m", quantization="q4_1", device="cuda")
    # The tied embedding of the real GGUF is Q8_0: refused before any tensor is read.
    with pytest.raises(InvalidRequestError, match=r"embed_tokens\.weight is Q8_0"):
        smollm2_checkpoint.gguf_blocks(lambda name: True, "Q4_1")
    not_gguf = dataclasses.replace(smollm2_checkpoint, read_blocks=None)
    with pytest.raises(InvalidRequestError, match="is not a GGUF file"):
        not_gguf.gguf_blocks(lambda name: True, "Q4_1")


def test_a_q4_1_file_s_blocks_can_be_kept_where_every_shard_falls_on_blocks(
    smollm2_checkpoint: Checkpoint,
) -> None:
    # SmolLM2's o and down projections split along K (576 and 1536 weights) fall on whole
    # 32-weight blocks over 1 and 2 ranks, not over 4 (144 a shard).
    assert keeps_q4_1_blocks(smollm2_checkpoint, 1)
    assert keeps_q4_1_blocks(smollm2_checkpoint, 2)
    assert not keeps_q4_1_blocks(smollm2_checkpoint, 4)
    one_f16 = dict(smollm2_checkpoint.gguf_types, **{"model.layers.7.mlp.up_proj.weight": "F16"})
    assert not keeps_q4_1_blocks(dataclasses.replace(smollm2_checkpoint, gguf_types=one_f16), 1)
    not_gguf = dataclasses.replace(smollm2_checkpoint, read_blocks=None, gguf_types={})
    assert not keeps_q4_1_blocks(not_gguf, 1)


@pytest.mark.parametrize("has_bf16", [True, False])
def test_auto_keeps_q4_1_blocks_on_avx512_cpus(
    has_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_module, "_cpu_has_native_bf16", lambda: has_bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    assert EngineConfig("m", device="cpu").weight_quantization(keeps_q4_1=True) == "q4_1"
    # An explicit dtype, another setting or a file that cannot be kept: as before.
    pinned = EngineConfig("m", device="cpu", dtype="float32")
    assert pinned.weight_quantization(keeps_q4_1=True) == "none"
    kept_as = EngineConfig("m", device="cpu", quantization="none")
    assert kept_as.weight_quantization(keeps_q4_1=True) == "none"
    before = "none" if has_bf16 else "int8"
    assert EngineConfig("m", device="cpu").weight_quantization(keeps_q4_1=False) == before
    # Without AVX-512 the blocks would be read by the portable loop: not chosen.
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    assert EngineConfig("m", device="cpu").weight_quantization(keeps_q4_1=True) == before


def test_the_real_gguf_s_blocks_are_its_dequantized_weights(
    smollm2_checkpoint: Checkpoint,
) -> None:
    """Rows come back in Hugging Face order: Q and K rows un-permuted like the dequantized
    tensors."""
    names = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.mlp.down_proj.weight"}  # fmt: skip
    blocks = dict(smollm2_checkpoint.gguf_blocks(names.__contains__, "Q4_1"))
    dense = dict(smollm2_checkpoint.tensors(names.__contains__))
    assert blocks.keys() == names
    for name in names:
        weight = BlockWeight.from_gguf(blocks[name], Q4_1, torch.float32)
        assert torch.equal(weight.dequantized(), dense[name])
    head = "model.embed_tokens.weight"
    [(_, head_blocks)] = smollm2_checkpoint.gguf_blocks(head.__eq__, "Q8_0")
    [(_, head_dense)] = smollm2_checkpoint.tensors(head.__eq__)
    assert torch.equal(
        BlockWeight.from_gguf(head_blocks, Q8_0, torch.float32).dequantized(), head_dense
    )


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
            cpu_kv_cache_gib=KV_CACHE_GIB, enable_prefix_caching=False)
        for quantization in ("none", "q4_1")
    )  # fmt: skip
    model = q4_1.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert len(layers) == 4 * 30
    assert all(isinstance(m.quantized, BlockWeight) and m.weight.numel() == 0 for m in layers)
    assert model.embed_tokens is not None and model.embed_tokens.head_blocks is not None
    assert model.embed_tokens.head_blocks.format is Q8_0

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
