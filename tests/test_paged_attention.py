"""Paged attention: the native CPU decode kernel against the portable PyTorch path, and both
against attention computed densely from each sequence's own keys."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_feature_digest, cpu_kernels
from engine.model.attention import AttentionMetadata, paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64


def random_batch(
    context_lens: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[torch.Tensor]]:
    """A cache holding each sequence's keys/values in scattered blocks, plus dense copies."""
    gen = torch.Generator().manual_seed(len(context_lens))
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = []
    for n in context_lens:
        num_blocks = -(-n // BLOCK_SIZE)
        tables.append([order.pop() for _ in range(num_blocks)])
    q = torch.randn(len(context_lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, [torch.tensor(t) for t in tables]


def dense_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: list[list[int]],
    lens: list[int],
) -> torch.Tensor:
    outs = []
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        k = k_cache[table].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].float()
        v = v_cache[table].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].float()
        k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).transpose(0, 1)
        v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v).squeeze(1))
    return torch.stack(outs)


def decode_metadata(tables: list[list[int]], lens: list[int], with_mask: bool) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    context = torch.tensor(lens)
    mask = None
    if with_mask:
        mask = (torch.arange(width * BLOCK_SIZE)[None, :] < context[:, None])[:, None, None, :]
    return AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), padded, context, mask, [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_kernel", [False, True])
def test_decode_attention_equals_dense_attention(dtype: torch.dtype, with_kernel: bool) -> None:
    if with_kernel and cpu_kernels() is None:
        pytest.skip("the native CPU kernel could not be built here")
    lens = [1, 3, 4, 5, 17, 33]  # block-aligned and not, one token, several blocks
    q, k_cache, v_cache, tables, _ = random_batch(lens, dtype)
    meta = decode_metadata(tables, lens, with_mask=not with_kernel)
    # No new tokens to write: slot_mapping is empty, so the call only reads the cache.
    empty_kv = torch.empty(0, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    out = paged_attention(q, empty_kv, empty_kv, k_cache, v_cache, meta)
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(
        out.float(), dense_reference(q, k_cache, v_cache, tables, lens), **tolerance
    )


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
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
    )
    assert loaded.returncode == 0, loaded.stderr
    assert kernels.__name__ in loaded.stdout and not stale.exists()
