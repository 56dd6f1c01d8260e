"""Attention over the paged KV cache.

Cache layout per layer: (num_blocks, block_size, num_kv_heads, head_dim), so a block is one
contiguous slab and a token's slot is `block_id * block_size + offset`. A step's tokens come
flattened, single-token queries first (decodes, batched into one padded call), then each
multi-token chunk (prefills, one call each, causal with the chunk's offset into its context).
The cache holds the model's dtype or fp8 (`kv_cache_dtype`, model/kv_quant.py), which every
path widens as it reads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels
from engine.model.kv_quant import gather_blocks, is_quantized

logger = logging.getLogger(__name__)

# (q, k_cache, v_cache, block_tables, context_lens, scale) -> out: reads the blocks in place.
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
# (q, k_cache, v_cache, block_ids, num_context_tokens, scale) -> out: one chunk, causal, reads
# its context and its own keys (already written) in place.
PrefillKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


@dataclass(slots=True)
class PrefillChunk:
    start: int  # index of the chunk's first token in the step's flattened tokens
    num_tokens: int
    num_context_tokens: int  # tokens of this sequence before the chunk, already in the cache
    block_ids: torch.Tensor  # (num_blocks,) the sequence's blocks covering context + chunk
    # (num_tokens, num_context_tokens + num_tokens), True where a query may attend.
    mask: torch.Tensor | None  # None when there is no context: plain causal attention

    def to(self, device: torch.device) -> PrefillChunk:
        mask = None if self.mask is None else self.mask.to(device, non_blocking=True)
        return replace(self, block_ids=self.block_ids.to(device, non_blocking=True), mask=mask)


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step; shared by every layer."""

    slot_mapping: torch.Tensor  # (num_tokens,) cache slot of each token's K and V
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks) padded with block 0
    decode_context_lens: torch.Tensor  # (num_decodes,) keys each decode attends to
    # (num_decodes, 1, 1, max_blocks * block_size) valid keys, for the portable path; None
    # when the native kernel reads the block tables itself.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same metadata on `device` (itself where it already is)."""
        if self.slot_mapping.device == device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return AttentionMetadata(
            move(self.slot_mapping),
            self.num_decode_tokens,
            move(self.decode_block_tables),
            move(self.decode_context_lens),
            None if self.decode_mask is None else move(self.decode_mask),
            [chunk.to(device) for chunk in self.prefills],
        )


def paged_decode_kernel(device: torch.device, cache_dtype: torch.dtype) -> DecodeKernel | None:
    """The decode kernel that reads a cache of `cache_dtype` in place on `device`: the C++ one
    on CPU, the Triton one on CUDA (not for an fp8 cache: untried there). None: decodes gather
    their blocks for SDPA (the portable path)."""
    if device.type == "cpu":
        kernels = cpu_kernels()
        return None if kernels is None else kernels.paged_decode_attention
    if device.type == "cuda" and cache_dtype != torch.float8_e4m3fn:
        return _triton_decode_kernel()
    return None


def paged_prefill_kernel(device: torch.device, head_dim: int) -> PrefillKernel | None:
    """The prefill kernel that reads the cache in place: the C++ one, on CPUs with AVX-512 and
    heads a multiple of 64 up to 256. None: chunks gather their context for SDPA (the portable
    path)."""
    return _cpu_prefill_kernel(head_dim) if device.type == "cpu" else None


@cache
def _cpu_prefill_kernel(head_dim: int) -> PrefillKernel | None:
    kernels = cpu_kernels()
    if kernels is None or not kernels.paged_prefill_supported(head_dim):
        return None
    return kernels.paged_prefill_attention


@cache
def _triton_decode_kernel() -> DecodeKernel | None:
    # MERIDIAN_TRITON_KERNELS=0 keeps the portable path on CUDA, for comparisons.
    if os.environ.get("MERIDIAN_TRITON_KERNELS", "1") == "0":
        return None
    try:
        from engine.kernels.paged_attention_triton import paged_decode_attention
    except ImportError as exc:
        logger.warning("Triton unavailable, CUDA decodes gather their KV blocks: %s", exc)
        return None
    return paged_decode_attention


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q (T, H, D), k and v (T, KVH, D) for this step's tokens, already written to the cache
    -> (T, H, D)."""
    num_decodes = meta.num_decode_tokens
    if num_decodes == q.shape[0]:  # decodes only: the usual step, and no copy
        return _decode_attention(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    if num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], k_cache, v_cache, meta)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    num_seqs = q.shape[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if meta.decode_mask is None:
        kernel = paged_decode_kernel(q.device, k_cache.dtype)
        assert kernel is not None, "metadata built for a kernel that is not loaded"
        return kernel(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            head_dim**-0.5,
        )
    # Portable path: gather the blocks into a padded batch, (B, KVH, max_blocks * bs, D).
    block_ids = meta.decode_block_tables.view(-1)
    keys = gather_blocks(k_cache, block_ids, q.dtype)
    values = gather_blocks(v_cache, block_ids, q.dtype)
    keys = keys.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True
    )
    return out.squeeze(2)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    kernel = paged_prefill_kernel(q.device, head_dim)
    if kernel is not None:
        return kernel(
            q, k_cache, v_cache, chunk.block_ids, chunk.num_context_tokens, head_dim**-0.5
        )
    # A chunk without context attends to its own keys; from an 8-bit cache, as stored, as the
    # kernel and later decodes read them.
    if chunk.mask is None and not is_quantized(k_cache):
        keys, values = k, v
    else:
        num_keys = chunk.num_context_tokens + chunk.num_tokens
        keys = gather_blocks(k_cache, chunk.block_ids, q.dtype)
        keys = keys.view(-1, num_kv_heads, head_dim)[:num_keys]
        values = gather_blocks(v_cache, chunk.block_ids, q.dtype)
        values = values.view(-1, num_kv_heads, head_dim)[:num_keys]
    # (1, heads, tokens, D): the CPU flash kernel takes only 4-D inputs; 3-D falls back to math.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
