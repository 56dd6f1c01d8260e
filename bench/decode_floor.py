"""The floor of a single-stream decode step: the bytes it must read over the memory bandwidth.

At batch 1 every weight is used once per step, so a step cannot take less than reading its
weights (as the step reads them: Q4_1 or Q8_0 blocks, int8 rows, or the model's dtype) and its
sequence's K and V from memory. `bench.engine_throughput --concurrency 1` prints this floor beside
the measured ITL.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine.llm_engine import LLMEngine
from engine.model.block_weights import BlockWeight
from engine.model.int8_weights import Int8Weight
from engine.model.llama import LlamaForCausalLM, RMSNorm
from engine.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

_BANDWIDTH_BYTES = 512 * 2**20  # 16x the last-level cache of the EPYC measured here


@dataclass(frozen=True, slots=True)
class DecodeFloor:
    weight_bytes: int  # what one single-token step reads of the weights
    kv_bytes: float  # K and V of the mean context a decode step attended to
    mean_context: float
    bandwidth_bytes_per_s: float

    @property
    def floor_s(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.bandwidth_bytes_per_s

    def summary(self) -> dict[str, float]:
        return {
            "weight_mb": round(self.weight_bytes / 1e6, 1),
            "kv_mb": round(self.kv_bytes / 1e6, 2),
            "mean_context": round(self.mean_context, 1),
            "read_gb_per_s": round(self.bandwidth_bytes_per_s / 1e9, 1),
            "floor_ms": round(self.floor_s * 1e3, 2),
        }


def step_weight_bytes(model: LlamaForCausalLM) -> int:
    """The weight bytes a one-token step reads: each projection as its step reads it, the norms,
    one embedding row and the LM head (its blocks where a one-token step reads them)."""
    total = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            total += _linear_bytes(module.weight, module.quantized)
        elif isinstance(module, RMSNorm):
            total += module.weight.nbytes
    if model.embed_tokens is not None:
        total += model.embed_tokens.weight[0].nbytes
    head = model.lm_head or model.embed_tokens
    if model.is_last and head is not None:
        total += _head_bytes(head)
    return total


def _head_bytes(head: VocabParallelEmbedding) -> int:
    if head.head_blocks is not None and head.head_blocks.kernels_for(head.weight[:1]):
        return head.head_blocks.blocks.numel()
    return _linear_bytes(head.weight, head.int8)


def _linear_bytes(weight: torch.Tensor, quantized: Int8Weight | BlockWeight | None) -> int:
    if isinstance(quantized, BlockWeight):
        return quantized.blocks.numel()
    if isinstance(quantized, Int8Weight):
        scales = quantized.scales
        return quantized.qweight.numel() + scales.numel() * scales.element_size()
    return weight.numel() * weight.element_size()


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second that torch's threads read from memory (the median of `repeats` sums
    of a buffer far larger than the caches). Measure it before an engine runs: the engine sets
    torch's thread count per step (engine/step_threads.py), one thread under load."""
    buffer = torch.ones(_BANDWIDTH_BYTES // 4)
    buffer.sum()  # the pages mapped
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - started)
    return _BANDWIDTH_BYTES / statistics.median(times)


def decode_floor(engine: LLMEngine, mean_context: float, bandwidth: float) -> DecodeFloor:
    """The floor of `engine`'s one-token steps at `mean_context` tokens of context, reading
    `bandwidth` bytes a second."""
    runner = engine.executor.runner
    kv_per_token = (
        runner.kv_bytes_per_block_per_layer
        * engine.model_config.num_layers
        / engine.config.block_size
    )
    return DecodeFloor(
        step_weight_bytes(runner.model),
        kv_per_token * mean_context,
        mean_context,
        bandwidth,
    )
