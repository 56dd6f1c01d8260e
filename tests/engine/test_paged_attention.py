"""Paged attention: the native CPU decode kernel against the portable PyTorch path, and both
against attention computed densely from each sequence's own keys."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _pytest.mark import ParameterSet

from engine.kernels import cpu_feature_digest, cpu_kernels
from engine.model import attention
from engine.model.attention import (
    AttentionMetadata,
    PrefillChunk,
    paged_attention,
    paged_decode_kernel,
    paged_prefill_kernel,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64


@dataclass(frozen=True)
class Heads:
    num_heads: int = NUM_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM


# The CPU kernel keeps queries and sums in AVX-512 registers for heads of 64 and 128 with up to
# 4 and 2 query heads per KV head (SmolLM2: 9 over 3, of 64); other shapes take its plain loop.
KERNEL_SHAPES = [Heads(), Heads(9, 3, 64), Heads(4, 2, 128), Heads(8, 1, 128)]


def random_batch(
    context_lens: list[int],
    dtype: torch.dtype,
    block_size: int = BLOCK_SIZE,
    heads: Heads = Heads(),
    num_blocks: int = NUM_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[torch.Tensor]]:
    """A cache holding each sequence's keys/values in scattered blocks, plus dense copies."""
    gen = torch.Generator().manual_seed(len(context_lens))
    shape = (num_blocks, block_size, heads.num_kv_heads, heads.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in context_lens:
        tables.append([order.pop() for _ in range(-(-n // block_size))])
    q = torch.randn(len(context_lens), heads.num_heads, heads.head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, [torch.tensor(t) for t in tables]


def dense_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: list[list[int]],
    lens: list[int],
) -> torch.Tensor:
    outs = []
    num_kv_heads, head_dim = k_cache.shape[-2:]
    group = q.shape[1] // num_kv_heads
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        k = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:n].float()
        v = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v).squeeze(1))
    return torch.stack(outs)


def decode_metadata(
    tables: list[list[int]], lens: list[int], with_mask: bool, block_size: int = BLOCK_SIZE
) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    context = torch.tensor(lens)
    mask = None
    if with_mask:
        mask = (torch.arange(width * block_size)[None, :] < context[:, None])[:, None, None, :]
    return AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), padded, context, mask, [])


# The kernel runs in every dtype it loads; the portable path is the same code in every dtype
# (SDPA's dtypes are torch's), so it runs in fp32 only, whose tight tolerance is the one that would
# see a key masked wrongly.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def on_the_kernel(name: str, *case: object) -> list[ParameterSet]:
    return [
        pytest.param(dtype, *case, True, id=f"kernel-{name}-{str(dtype).removeprefix('torch.')}")
        for dtype in DTYPES
    ]


def on_the_portable_path(name: str, *case: object) -> ParameterSet:
    return pytest.param(torch.float32, *case, False, id=f"portable-{name}")


@pytest.mark.parametrize(
    ("dtype", "heads", "with_kernel"),
    [case for heads in KERNEL_SHAPES for case in on_the_kernel(str(heads), heads)]
    + [on_the_portable_path(str(heads), heads) for heads in KERNEL_SHAPES],
)
def test_decode_attention_equals_dense_attention(
    dtype: torch.dtype, heads: Heads, with_kernel: bool
) -> None:
    if with_kernel and cpu_kernels() is None:
        pytest.skip("the native CPU kernel could not be built here")
    # Block-aligned and not, one token, several blocks (more than 16 tokens in a block of 32).
    lens = [1, 3, 4, 5, 17, 33, 60]
    block_size = 32 if heads.head_dim > HEAD_DIM else BLOCK_SIZE
    q, k_cache, v_cache, tables, _ = random_batch(lens, dtype, block_size, heads)
    meta = decode_metadata(tables, lens, with_mask=not with_kernel, block_size=block_size)
    # No new tokens to write: slot_mapping is empty, so the call only reads the cache.
    empty_kv = torch.empty(0, heads.num_kv_heads, heads.head_dim, dtype=dtype)
    out = paged_attention(q, empty_kv, empty_kv, k_cache, v_cache, meta)
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(
        out.float(), dense_reference(q, k_cache, v_cache, tables, lens), **tolerance
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [Heads(9, 3, 64), Heads(4, 2, 128)], ids=["64", "128"])
def test_a_long_context_split_into_parts_equals_dense_attention_and_itself_alone(
    dtype: torch.dtype, heads: Heads
) -> None:
    """Past 512 tokens the kernel splits a context into parts of whole blocks, each on a thread
    of its own, and merges them: two and three parts, block-aligned and not, a split context
    across two threads' ranges; the parts follow from the context alone, so a sequence's
    output is the same bits in a batch as alone."""
    if cpu_kernels() is None:
        pytest.skip("the native CPU kernel could not be built here")
    lens = [1040, 513, 37, 700]
    block_size = 32 if heads.head_dim > HEAD_DIM else BLOCK_SIZE * 4
    q, k_cache, v_cache, tables, _ = random_batch(lens, dtype, block_size, heads, num_blocks=160)
    empty_kv = torch.empty(0, heads.num_kv_heads, heads.head_dim, dtype=dtype)

    def attend(rows: slice, seqs: list[int]) -> torch.Tensor:
        meta = decode_metadata(
            [tables[i] for i in seqs], [lens[i] for i in seqs], False, block_size
        )
        return paged_attention(q[rows], empty_kv, empty_kv, k_cache, v_cache, meta)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = attend(slice(None), list(range(len(lens))))
        alone = [attend(slice(i, i + 1), [i]) for i in range(len(lens))]
    finally:
        torch.set_num_threads(threads)
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(
        out.float(), dense_reference(q, k_cache, v_cache, tables, lens), **tolerance
    )
    assert torch.equal(torch.cat(alone), out)


def test_an_empty_context_attends_to_nothing() -> None:
    if cpu_kernels() is None:
        pytest.skip("the native CPU kernel could not be built here")
    lens, heads = [0, 5], Heads(9, 3, 64)
    q, k_cache, v_cache, tables, _ = random_batch(lens, torch.bfloat16, 16, heads)
    empty_kv = torch.empty(0, heads.num_kv_heads, heads.head_dim, dtype=torch.bfloat16)
    meta = decode_metadata([[0], tables[1]], lens, False, 16)
    out = paged_attention(q, empty_kv, empty_kv, k_cache, v_cache, meta)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(
        out[1:].float(), dense_reference(q[1:], k_cache, v_cache, tables[1:], lens[1:]),
        atol=2e-2, rtol=2e-2,
    )  # fmt: skip


def prefill_metadata(
    tables: list[list[int]], contexts: list[int], chunks: list[int]
) -> AttentionMetadata:
    """Metadata for one prefill chunk per sequence, each `chunks[i]` tokens after
    `contexts[i]` cached ones."""
    prefills, start = [], 0
    for table, context, n in zip(tables, contexts, chunks, strict=True):
        mask = None
        if context:
            keys = torch.arange(context + n)[None, :]
            mask = keys <= (context + torch.arange(n))[:, None]
        prefills.append(PrefillChunk(start, n, context, torch.tensor(table), mask))
        start += n
    empty = torch.empty(0, dtype=torch.long)
    return AttentionMetadata(empty, 0, empty, empty, None, prefills)


def causal_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: list[list[int]],
    contexts: list[int],
    chunks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chunk's own keys and values (as the layer passes them, already in the cache) and
    each query's attention over the keys up to its own position, one query at a time."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    group = q.shape[1] // num_kv_heads
    ks, vs, expected = [], [], []
    for i, (table, context, n) in enumerate(zip(tables, contexts, chunks, strict=True)):
        keys = k_cache[table].reshape(-1, num_kv_heads, head_dim)[: context + n]
        values = v_cache[table].reshape(-1, num_kv_heads, head_dim)[: context + n]
        ks.append(keys[context:])
        vs.append(values[context:])
        rows = q[sum(chunks[:i]) : sum(chunks[: i + 1])]
        for t in range(n):
            one = rows[t : t + 1].float()
            k = keys[: context + t + 1].float().repeat_interleave(group, dim=1).transpose(0, 1)
            v = values[: context + t + 1].float().repeat_interleave(group, dim=1).transpose(0, 1)
            out = F.scaled_dot_product_attention(one.transpose(0, 1), k, v)  # (H, 1, D)
            expected.append(out.transpose(0, 1))
    return torch.cat(ks), torch.cat(vs), torch.cat(expected)


def prefill_kernel_or_skip(head_dim: int) -> None:
    if paged_prefill_kernel(torch.device("cpu"), head_dim) is None:
        pytest.skip("no native prefill kernel here (it needs AVX-512 and heads of 64k)")


# The portable path on the small heads and on SmolLM2's; the kernel on the shapes it serves, with
# contexts and chunks that start and end inside its tiles of 16 queries and its chunks of 64 keys.
SMOLLM2_PREFILL = (Heads(9, 3, 64), 16, [0, 5, 70, 128], [7, 40, 100, 3])
PREFILL_CASES = [
    on_the_portable_path("small", Heads(), 4, [0, 5, 12], [7, 9, 4]),
    on_the_portable_path("64", *SMOLLM2_PREFILL),
    *on_the_kernel("64", *SMOLLM2_PREFILL),
    *on_the_kernel("128", Heads(4, 2, 128), 16, [0, 63, 200], [130, 2, 17]),
    *on_the_kernel("mha", Heads(8, 1, 128), 16, [33], [65]),
]


@pytest.mark.parametrize(
    ("dtype", "heads", "block_size", "contexts", "chunks", "with_kernel"), PREFILL_CASES
)
def test_prefill_attention_equals_dense_causal_attention(
    dtype: torch.dtype,
    heads: Heads,
    block_size: int,
    contexts: list[int],
    chunks: list[int],
    with_kernel: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if with_kernel:
        prefill_kernel_or_skip(heads.head_dim)
    else:
        monkeypatch.setattr(attention, "paged_prefill_kernel", lambda device, head_dim: None)
    lens = [c + n for c, n in zip(contexts, chunks, strict=True)]
    _, k_cache, v_cache, tables, _ = random_batch(lens, dtype, block_size, heads)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(chunks), heads.num_heads, heads.head_dim, generator=gen).to(dtype)
    k, v, expected = causal_reference(q, k_cache, v_cache, tables, contexts, chunks)
    out = paged_attention(q, k, v, k_cache, v_cache, prefill_metadata(tables, contexts, chunks))
    assert out.dtype == dtype
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(out.float(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_rows_do_not_depend_on_the_chunking(dtype: torch.dtype) -> None:
    """A prompt prefilled whole and in two chunks (split inside a tile and a key chunk) gives
    the same bits: what a node that resumes a stream relies on to match the first node."""
    heads = Heads(9, 3, 64)
    prefill_kernel_or_skip(heads.head_dim)
    _, k_cache, v_cache, tables, _ = random_batch([150], dtype, 16, heads)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(150, heads.num_heads, heads.head_dim, generator=gen).to(dtype)
    k, v, _ = causal_reference(q, k_cache, v_cache, tables, [0], [150])
    whole = paged_attention(q, k, v, k_cache, v_cache, prefill_metadata(tables, [0], [150]))
    parts = [
        paged_attention(q[a:b], k[a:b], v[a:b], k_cache, v_cache,
                        prefill_metadata(tables, [a], [b - a]))
        for a, b in [(0, 71), (71, 150)]
    ]  # fmt: skip
    assert torch.equal(whole, torch.cat(parts))


def test_prefill_kernel_rejects_blocks_short_of_the_chunk() -> None:
    prefill_kernel_or_skip(64)
    kernel = paged_prefill_kernel(torch.device("cpu"), 64)
    assert kernel is not None
    # Heads it has no buffers for take the portable path.
    assert paged_prefill_kernel(torch.device("cpu"), 320) is None
    cache = torch.zeros(4, 16, 3, 64)
    with pytest.raises(RuntimeError, match="do not cover"):
        kernel(torch.zeros(20, 9, 64), cache, cache, torch.tensor([0]), 0, 0.125)


# Runs the Triton decode kernel in Triton's interpreter, on CPU tensors: TRITON_INTERPRET must
# be set before triton is first imported (its own library functions are decorated then), so
# the kernel runs in a child process that starts with it.
_RUN_TRITON_KERNEL = """
import sys, torch
from engine.kernels.paged_attention_triton import paged_decode_attention
calls = torch.load(sys.argv[1])
assert not calls[0][0].is_contiguous(), "q arrives as the strided view it was saved as"
torch.save([paged_decode_attention(*args) for args in calls], sys.argv[2])
"""


def run_interpreted_triton_kernel(
    tmp_path: Path, calls: list[tuple[object, ...]]
) -> list[torch.Tensor]:
    """Each call's output, computed by the kernel in a child with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    torch.save(calls, tmp_path / "args.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-c", _RUN_TRITON_KERNEL, tmp_path / "args.pt", tmp_path / "out.pt"]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).parents[2])  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    outs: list[torch.Tensor] = torch.load(tmp_path / "out.pt")
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 3])
def test_triton_decode_kernel_equals_dense_attention(tmp_path: Path, block_size: int) -> None:
    """Blocks read in place, q a strided view into wider rows (as in the fused QKV rows), the
    caches' blocks of any size (3: padded to a power of two inside the kernel)."""
    lens = [1, 3, 4, 5, 17, 33]
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k_cache, v_cache, tables, _ = random_batch(lens, dtype, block_size)
        rows = torch.zeros(len(lens), NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        rows[:, :NUM_HEADS] = q
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        args = (rows[:, :NUM_HEADS], k_cache, v_cache, padded, torch.tensor(lens), HEAD_DIM**-0.5)
        cases.append((args, dense_reference(q, k_cache, v_cache, tables, lens)))
    # One child for both dtypes: starting triton's interpreter is most of the cost.
    outs = run_interpreted_triton_kernel(tmp_path, [args for args, _ in cases])
    for out, ((q_view, *_), expected) in zip(outs, cases, strict=True):
        assert out.dtype == q_view.dtype and out.shape == q_view.shape
        fp32 = out.dtype == torch.float32
        tolerance = {"atol": 1e-5, "rtol": 1e-5} if fp32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(out.float(), expected, **tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_kernel_on_cuda_equals_dense_attention(dtype: torch.dtype) -> None:
    """The kernel compiled for the GPU, through the engine's dispatch, as decodes call it."""
    lens = [1, 3, 4, 5, 17, 33]
    q, k_cache, v_cache, tables, _ = random_batch(lens, dtype)
    meta = decode_metadata(tables, lens, with_mask=False).to(torch.device("cuda"))
    empty_kv = torch.empty(0, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    out = paged_attention(q.cuda(), empty_kv, empty_kv, k_cache.cuda(), v_cache.cuda(), meta)
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    expected = dense_reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out.float().cpu(), expected, **tolerance)


def test_the_triton_kernel_is_chosen_for_cuda_only() -> None:
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    # An fp8 cache takes the portable path on CUDA: the Triton kernel is untried on it.
    assert paged_decode_kernel(torch.device("cuda"), fp8) is None
    triton_kernel = paged_decode_kernel(torch.device("cuda"), bf16)
    if triton_kernel is None:
        pytest.skip("triton is not installed here")
    assert triton_kernel.__module__ == "engine.kernels.paged_attention_triton"
    cpu_kernel = paged_decode_kernel(torch.device("cpu"), bf16)
    assert cpu_kernel is None or cpu_kernel.__module__ != triton_kernel.__module__
    assert paged_decode_kernel(torch.device("meta"), bf16) is None


def test_kernels_are_built_per_cpu_and_version() -> None:
    """-march=native objects must never load on another CPU: the module is named for this one,
    and for its sources, so that two versions of the engine do not rebuild it in turn."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the native CPU kernel could not be built here")
    digest = cpu_feature_digest()
    assert len(digest) == 12 and digest == cpu_feature_digest()
    name = kernels.__name__
    assert name.startswith(f"meridian_cpu_kernels_{digest}_") and len(name) == len(digest) + 30


@pytest.mark.slow
def test_a_build_killed_midway_does_not_hang_later_loads() -> None:
    """torch's `lock` file, left by a process killed while building, must not block a load."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the native CPU kernel could not be built here")
    from torch.utils.cpp_extension import _get_build_directory

    stale = Path(_get_build_directory(kernels.__name__, verbose=False)) / "lock"
    stale.touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from engine.kernels import cpu_kernels; print(cpu_kernels())"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert loaded.returncode == 0, loaded.stderr
    assert kernels.__name__ in loaded.stdout and not stale.exists()
