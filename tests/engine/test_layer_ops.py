"""The fused CPU layer ops against their eager PyTorch twins. They round through the storage
type at the same points, so they differ only where a sum's order or a fused multiply-add moves
a float by an ulp: fp32 within 1e-5, bf16 in a few elements by a step or two (a rounding that
went the other way, carried through the next one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.model import layer_ops
from engine.model.layer_ops import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels could not be built")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 96, 6, 2, 16, 4, 128


def both_paths(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], Any]) -> tuple[Any, Any]:
    """fn() through the kernels, then through the eager twin."""
    fused = fn()
    with monkeypatch.context() as m:
        m.setattr(layer_ops, "_kernels_for", lambda x: None)
        eager = fn()
    return fused, eager


def assert_same(fused: torch.Tensor, eager: torch.Tensor) -> None:
    if fused.dtype == torch.bfloat16:
        torch.testing.assert_close(fused, eager, atol=1e-5, rtol=2**-6)
        assert (fused != eager).float().mean() < 0.05
    else:
        torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)


DTYPES = [torch.float32, torch.bfloat16]
TOKEN_COUNTS = [1, 7, 300]  # one decode; a few; enough rows to run on several threads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_add_rms_norm_equals_eager(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, num_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * 3).to(dtype)
    residual = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    weight = torch.rand(HIDDEN, generator=gen).to(dtype)
    (fused, fused_res), (eager, eager_res) = both_paths(
        monkeypatch, lambda: layer_ops.add_rms_norm(x, residual.clone(), weight, 1e-5)
    )
    assert_same(fused, eager)
    assert_same(fused_res, eager_res)
    assert_same(fused_res, x + residual)
    norm_fused, norm_eager = both_paths(monkeypatch, lambda: layer_ops.rms_norm(x, weight, 1e-5))
    assert_same(norm_fused, norm_eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_silu_and_mul_equals_eager(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, num_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    # Wide enough to reach exp's clamps: silu of -100 is -0, of 100 is 100.
    gate_up = (torch.randn(num_tokens, 2 * HIDDEN, generator=gen) * 30).to(dtype)
    fused, eager = both_paths(monkeypatch, lambda: layer_ops.silu_and_mul(gate_up))
    assert_same(fused, eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_rope_and_write_kv_equals_eager(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, num_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)
    positions = torch.randint(0, 2000, (num_tokens,), generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    angles = RotaryEmbedding(HEAD_DIM, 10_000.0, 2048, torch.device("cpu")).at(positions, dtype)

    def run() -> tuple[torch.Tensor, ...]:
        caches = tuple(
            torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in "kv"
        )
        q, k, v = angles.rope_and_write_kv(qkv.clone(), (caches[0], caches[1]), slots, HEADS)
        return q, k, v, *caches

    for fused, eager in zip(*both_paths(monkeypatch, run), strict=True):
        assert_same(fused, eager)
