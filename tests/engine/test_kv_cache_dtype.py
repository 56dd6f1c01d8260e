"""An fp8 KV cache (`kv_cache_dtype="fp8"`): the quantization's bounds, the write kernel against
the eager path, paged attention over an fp8 cache against dense attention (exact on the cache's
own values, close to the unquantized ones), a tiny model end to end, and the pool's size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_model import KV_CACHE_GIB
from test_paged_attention import (
    KERNEL_SHAPES,
    Heads,
    causal_reference,
    decode_metadata,
    dense_reference,
    prefill_kernel_or_skip,
    prefill_metadata,
    random_batch,
)
from tiny_checkpoints import save_tiny_transformers_model

from bench.kv_cache_accuracy import QUESTIONS, prompt_logits
from engine import LLM, SamplingParams
from engine.config import EngineConfig, WeightsFormat
from engine.errors import InvalidRequestError
from engine.kernels import cpu_kernels
from engine.model import attention, layer_ops
from engine.model.attention import paged_attention
from engine.model.kv_quant import FP8, FP8_MAX, quantize, write_slots
from engine.model.layer_ops import RotaryEmbedding

# Dense attention over random unit-normal keys and values, fp8 against unquantized: e4m3's
# relative error of at most 1/16 per element moves an output by up to ~0.13 (0.12 seen).
FP8_ATTENTION_ATOL = 0.2


def test_fp8_round_trip_is_within_half_a_step() -> None:
    magnitudes = torch.logspace(-4, 2.6, 4000)  # 1e-4 .. ~400: subnormals to near the top
    x = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, 448.0, 500.0, -1e4])])
    back = quantize(x).float()
    assert quantize(x).dtype == FP8 and not back.isnan().any()
    error = (back - x).abs()
    normal = (x.abs() >= 2**-6) & (x.abs() <= FP8_MAX)
    # 3 mantissa bits: half a step is 1/16 of the value's power of two, so <= |x| / 16.
    assert bool((error[normal] <= x[normal].abs() / 16).all())
    # Below 2^-6 the steps are 2^-9 apart.
    assert bool((error[x.abs() < 2**-6] <= 2**-10).all())
    # Beyond the largest finite value it saturates (a plain cast gives NaN).
    assert back[-3:].tolist() == [FP8_MAX, FP8_MAX, -FP8_MAX]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_write_kernel_stores_the_bits_the_eager_path_stores(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cpu_kernels() is None:
        pytest.skip("the native CPU kernels could not be built here")
    heads = Heads(9, 3, 64)
    num_tokens = 7
    gen = torch.Generator().manual_seed(5)
    width = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    qkv = (torch.randn(num_tokens, width, generator=gen) * 150).to(dtype)  # some past +-448
    rope = RotaryEmbedding(heads.head_dim, 10000.0, 64, torch.device("cpu"))
    angles = rope.at(torch.arange(3, 3 + num_tokens), dtype)
    slots = torch.tensor([5, 9, 10, 11, 30, 2, 0])
    caches = []
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(layer_ops, "_kernels_for", lambda x: None)
        cache = torch.zeros(2, 8, 4, heads.num_kv_heads, heads.head_dim, dtype=FP8)
        angles.rope_and_write_kv(qkv.clone(), (cache[0], cache[1]), slots, heads.num_heads)
        caches.append(cache)
    # Rotation rounds alike on both paths, and both quantize with saturation.
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert caches[0].view(torch.uint8).any()


def fp8_batch(
    lens: list[int], dtype: torch.dtype, block_size: int, heads: Heads
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """random_batch's query and cache, the cache quantized: q, k8, v8, k, v, tables."""
    q, k_cache, v_cache, tables, _ = random_batch(lens, dtype, block_size, heads)
    return q, quantize(k_cache), quantize(v_cache), k_cache, v_cache, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "portable"])
@pytest.mark.parametrize("heads", KERNEL_SHAPES, ids=str)
def test_decode_attention_over_an_fp8_cache(
    dtype: torch.dtype, with_kernel: bool, heads: Heads
) -> None:
    if with_kernel and cpu_kernels() is None:
        pytest.skip("the native CPU kernel could not be built here")
    lens = [1, 3, 4, 5, 17, 33, 60]
    block_size = 32 if heads.head_dim > 16 else 4
    q, k8, v8, k_cache, v_cache, tables = fp8_batch(lens, dtype, block_size, heads)
    meta = decode_metadata(tables, lens, with_mask=not with_kernel, block_size=block_size)
    empty_kv = torch.empty(0, heads.num_kv_heads, heads.head_dim, dtype=dtype)
    out = paged_attention(q, empty_kv, empty_kv, k8, v8, meta)
    assert out.dtype == dtype
    # What the cache holds, read exactly: as attention over its values widened.
    on_fp8 = dense_reference(q, k8.to(dtype), v8.to(dtype), tables, lens)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), on_fp8, atol=tolerance, rtol=tolerance)
    unquantized = dense_reference(q, k_cache, v_cache, tables, lens)
    assert float((out.float() - unquantized).abs().max()) < FP8_ATTENTION_ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "portable"])
def test_prefill_attention_over_an_fp8_cache(
    dtype: torch.dtype, with_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads, contexts, chunks = Heads(9, 3, 64), [0, 5, 70], [7, 40, 100]
    if with_kernel:
        prefill_kernel_or_skip(heads.head_dim)
    else:
        monkeypatch.setattr(attention, "paged_prefill_kernel", lambda device, head_dim: None)
    lens = [c + n for c, n in zip(contexts, chunks, strict=True)]
    _, k8, v8, k_cache, v_cache, tables = fp8_batch(lens, dtype, 16, heads)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(chunks), heads.num_heads, heads.head_dim, generator=gen).to(dtype)
    k, v, on_fp8 = causal_reference(q, k8.to(dtype), v8.to(dtype), tables, contexts, chunks)
    # Every path reads a chunk's own keys from the cache too, as later decodes read them.
    out = paged_attention(q, k, v, k8, v8, prefill_metadata(tables, contexts, chunks))
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), on_fp8, atol=tolerance, rtol=tolerance)
    *_, unquantized = causal_reference(q, k_cache, v_cache, tables, contexts, chunks)
    assert float((out.float() - unquantized).abs().max()) < FP8_ATTENTION_ATOL


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Heads of 64, so that both CPU kernels (decode and prefill) run."""
    folder = tmp_path_factory.mktemp("tiny-llama-64")
    save_tiny_transformers_model(
        folder, "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    return folder


def test_a_tiny_model_on_an_fp8_cache_stays_close(tiny_model: Path) -> None:
    full, fp8 = (
        LLM(str(tiny_model), dtype="float32", kv_cache_dtype=kv, num_kv_blocks=64)
        for kv in ("auto", "fp8")
    )
    assert fp8.engine.executor.runner.kv_caches[0][0].dtype == FP8
    ids = list(range(3, 60))
    ours, reference = prompt_logits(fp8.engine, ids), prompt_logits(full.engine, ids)
    # The random model's logits span ~1; fp8 keys and values move them by a few hundredths.
    assert float((ours - reference).abs().max()) < 0.05 * float(reference.abs().max())
    # Decoding reads the fp8 cache through the decode kernel: the same greedy tokens here.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [a], [b] = (
        full.generate([{"prompt_token_ids": ids}], params),
        fp8.generate([{"prompt_token_ids": ids}], params),
    )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_fp8_holds_twice_the_blocks_in_the_same_bytes(tiny_model: Path) -> None:
    budget_gib = 2 / 1024  # 2 MiB
    auto, fp8 = (
        LLM(str(tiny_model), dtype="bfloat16", kv_cache_dtype=kv, cpu_kv_cache_gib=budget_gib)
        for kv in ("auto", "fp8")
    )
    blocks = [llm.engine.scheduler.kv_cache.num_blocks for llm in (auto, fp8)]
    assert blocks[1] == 2 * blocks[0]
    runners = [llm.engine.executor.runner for llm in (auto, fp8)]
    assert runners[1].kv_bytes_per_block_per_layer * 2 == runners[0].kv_bytes_per_block_per_layer
    cache_bytes = [sum(k.nbytes + v.nbytes for k, v in r.kv_caches) for r in runners]
    assert cache_bytes[0] == cache_bytes[1] <= budget_gib * 2**30


def test_the_setting_is_checked_and_reported() -> None:
    with pytest.raises(InvalidRequestError, match=r"kv_cache_dtype must be one of \['auto'"):
        EngineConfig("m", kv_cache_dtype="int4")
    assert EngineConfig("m").kv_torch_dtype(torch.bfloat16) == torch.bfloat16
    assert EngineConfig("m", kv_cache_dtype="fp8").kv_torch_dtype(torch.bfloat16) == FP8
    # A node with an fp8 cache writes other text: its reported quantization says so.
    assert WeightsFormat.of(torch.bfloat16, "q4_1", "auto").reported_quantization == "q4_1"
    fp8 = WeightsFormat.of(torch.bfloat16, "q4_1", "fp8")
    assert fp8.reported_quantization == "q4_1_kv_fp8"


def test_writes_to_a_model_dtype_cache_are_unchanged() -> None:
    cache = torch.zeros(4, 2, 1, 3)
    x = torch.randn(3, 1, 3)
    write_slots(cache, torch.tensor([0, 5, 7]), x)
    assert torch.equal(cache.view(-1, 1, 3)[[0, 5, 7]], x)


@pytest.mark.slow
def test_the_real_model_on_an_fp8_cache_stays_within_the_stated_tolerance(
    smollm2_gguf: Path,
) -> None:
    """docs/engine.md's tolerance, on the chat questions of bench.kv_cache_accuracy: the first
    step's logits within 3.0 of the auto cache's (their range is ~47), the top-1 token equal at
    most of the prompts' positions."""
    auto, fp8 = (
        LLM(str(smollm2_gguf), kv_cache_dtype=kv, cpu_kv_cache_gib=KV_CACHE_GIB)
        for kv in ("auto", "fp8")
    )
    tokenizer = auto.get_tokenizer()
    equal = positions = 0
    for question in QUESTIONS:
        ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": question}]))
        ours, reference = prompt_logits(fp8.engine, ids), prompt_logits(auto.engine, ids)
        assert float((ours[-1] - reference[-1]).abs().max()) < 3.0
        equal += int((ours.argmax(-1) == reference.argmax(-1)).sum())
        positions += len(ids)
    assert equal / positions >= 0.9, f"top-1 equal at {equal / positions:.0%} of positions"
