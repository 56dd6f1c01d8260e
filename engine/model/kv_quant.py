"""An 8-bit KV cache (`kv_cache_dtype="fp8"`): float8_e4m3fn, quantized on write, widened to
the model's dtype where attention reads it.

No scale, as vLLM's fp8 cache without calibrated scales: e4m3 keeps 3 mantissa bits at every
exponent from 2^-6 to 448, so a relative error of at most 1/16 whatever a head's magnitude,
and a block filled one token at a time never needs requantizing (a per-block scale would,
whenever a later token outgrew it). Values beyond +-448 saturate: a cast alone gives NaN.

torch's CPU ops copy and index fp8 tensors only as bytes, so writes and gathers go through a
uint8 view; the casts themselves are generic, on CPU and CUDA alike.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x in any float dtype -> fp8, saturating."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache (num_blocks, block_size, KVH, D)[slot] = x (T, KVH, D), quantized for an 8-bit
    cache."""
    num_kv_heads, head_dim = cache.shape[-2:]
    rows = cache.view(-1, num_kv_heads, head_dim)
    if is_quantized(cache):
        rows.view(torch.uint8).index_copy_(0, slots, quantize(x).view(torch.uint8))
    else:
        rows.index_copy_(0, slots, x)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[block_ids] in `dtype`: an 8-bit cache's blocks widened."""
    if not is_quantized(cache):
        return cache.index_select(0, block_ids)
    return cache.view(torch.uint8).index_select(0, block_ids).view(FP8).to(dtype)
