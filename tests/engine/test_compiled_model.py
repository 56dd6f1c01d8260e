"""bench/compiled_model.py's custom ops: each fake impl gives the shape, dtype and strides the C++
kernel returns, and the schema declares what it mutates (torch.library.opcheck), or Dynamo would
trace the compiled variants with wrong shapes or drop a KV write."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels could not be built")

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 8
HIDDEN = HEADS * HEAD_DIM


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def op_args() -> dict[str, tuple[object, ...]]:
    import bench.compiled_model  # noqa: F401  registers the ops

    num_tokens = 3
    cache = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {
        "rms_norm": (bf16(num_tokens, HIDDEN), bf16(HIDDEN), 1e-5),
        "add_rms_norm": (bf16(num_tokens, HIDDEN), bf16(num_tokens, HIDDEN), bf16(HIDDEN), 1e-5),
        "silu_and_mul": (bf16(num_tokens, 2 * HIDDEN),),
        "bf16_linear": (bf16(num_tokens, HIDDEN), bf16(2 * HIDDEN, HIDDEN)),
        "rope_and_write_kv": (
            bf16(num_tokens, qkv_width),
            bf16(num_tokens, HEAD_DIM),
            bf16(num_tokens, HEAD_DIM),
            bf16(*cache),
            bf16(*cache),
            torch.tensor([0, 5, 9]),
            HEADS,
            KV_HEADS,
        ),
        "paged_decode_attention": (
            bf16(num_tokens, HEADS, HEAD_DIM),
            bf16(*cache),
            bf16(*cache),
            torch.tensor([[0, 1], [2, 3], [4, 5]]),
            torch.tensor([5, 8, 1]),
            HEAD_DIM**-0.5,
        ),
    }


OPS = [
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "bf16_linear",
    "rope_and_write_kv",
    "paged_decode_attention",
]


@pytest.mark.parametrize("name", OPS)
def test_custom_op_matches_its_kernel(name: str) -> None:
    args = op_args()[name]
    torch.library.opcheck(
        getattr(torch.ops.meridian, name).default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )
