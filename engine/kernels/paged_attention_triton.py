"""Paged decode attention in Triton, for CUDA: each query reads its keys and values in place
from the sequence's cache blocks, with no gather into a padded batch.

One program per (sequence, KV head) walks the sequence's block table one cache block at a time
with an online softmax in fp32, for all the query heads that share the KV head (GQA), so each
key and value is read from memory once. Decode is bound by reading the cache, so the products
are elementwise multiplies and sums rather than `tl.dot`, which would need every dimension to be
at least 16 (a GQA group is 1-8 heads).

Only imported where the device is CUDA (`engine.model.attention`); the tests run the same code
on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, scale,
    stride_out_seq, stride_out_head, stride_q_seq, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_seq,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLOTS_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP_SIZE + tl.arange(0, GROUP_PAD)  # the query heads of this KV head
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, SLOTS_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP_SIZE
    dim_ok = dims < HEAD_DIM

    q_offsets = seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    q_mask = head_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale  # (G, D)

    context_len = tl.load(context_lens_ptr + seq)
    running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    for i in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_table_seq + i).to(tl.int64)
        slot_ok = (slots < BLOCK_SIZE) & (i * BLOCK_SIZE + slots < context_len)
        kv_offsets = (
            block * stride_cache_block
            + slots[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
            + dims[None, :]
        )
        kv_mask = slot_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # (S, D)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G, S)
        scores = tl.where(slot_ok[None, :], scores, float("-inf"))
        # Every block holds at least one valid slot, so the new maximum is finite.
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max

    out = acc / running_sum[:, None]
    out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q (B, H, D), rows and heads strided, the last dim contiguous (a view into the fused QKV
    rows is fine); caches (num_blocks, block_size, KVH, D); block_tables (B, max_blocks);
    context_lens (B,) -> (B, H, D) in q's dtype. The same contract as the CPU kernel's."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged decode attention needs head_dim contiguous, K and V alike")
    group_size = num_heads // num_kv_heads
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens, scale,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP_SIZE=group_size, GROUP_PAD=triton.next_power_of_2(group_size),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, SLOTS_PAD=triton.next_power_of_2(block_size),
    )  # fmt: skip
    return out
