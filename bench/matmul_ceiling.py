"""The bf16 matmul ceiling of a batched run: the processed tokens per second its projections allow.

A batched step's work is its projections (q, k, v, o, gate, up, down per layer; the LM head once
per output token) plus attention. The ceiling times those projections as bf16 GEMMs of the
model's own shapes, `tokens` rows at once (a full step of the default engine), on the threads the
engine uses, and divides: tokens/s = tokens / (the layers' matmul time + the LM head's, weighted
by the share of output tokens in the workload). Attention, dequantizing, norms and Python are all
left out, so no run can reach it. `bench.engine_throughput` prints it beside the run's processed
(prompt + output) tokens per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model_config import ModelConfig

_REPEATS = 5  # the best of these: a shared machine only ever slows a matmul down


@dataclass(frozen=True, slots=True)
class MatmulCeiling:
    tokens_per_s: float  # processed tokens per second the projections allow
    gflop_per_s: float  # the bf16 GEMMs' measured rate on these shapes
    gflop_per_token: float  # the projections' work per processed token of this workload

    def share(self, processed_tokens_per_s: float) -> float:
        return processed_tokens_per_s / self.tokens_per_s


def _layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one layer's projections."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    return [
        (q_out, hidden),
        (kv_out, hidden),
        (kv_out, hidden),
        (hidden, q_out),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ]


def _best_time(x: torch.Tensor, weight: torch.Tensor) -> float:
    F.linear(x, weight)  # warm: oneDNN picks and caches its kernel
    best = float("inf")
    for _ in range(_REPEATS):
        started = time.perf_counter()
        F.linear(x, weight)
        best = min(best, time.perf_counter() - started)
    return best


def matmul_ceiling(
    config: ModelConfig, output_share: float, threads: int, tokens: int = 512
) -> MatmulCeiling:
    """The ceiling for a workload whose processed tokens are `output_share` output tokens."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(config, output_share, tokens)
    finally:
        torch.set_num_threads(previous)


def _measure(config: ModelConfig, output_share: float, tokens: int) -> MatmulCeiling:
    layer_s = 0.0
    layer_flops = 0
    for out_features, in_features in _layer_shapes(config):
        x = torch.randn(tokens, in_features, dtype=torch.bfloat16)
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        layer_s += _best_time(x, weight)
        layer_flops += 2 * tokens * out_features * in_features
    x = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16)
    head = torch.randn(config.vocab_size, config.hidden_size, dtype=torch.bfloat16)
    head_s = _best_time(x, head) * output_share
    head_flops = 2 * tokens * config.vocab_size * config.hidden_size * output_share
    seconds = layer_s * config.num_layers + head_s
    flops = layer_flops * config.num_layers + head_flops
    return MatmulCeiling(
        tokens_per_s=tokens / seconds,
        gflop_per_s=flops / seconds / 1e9,
        gflop_per_token=flops / tokens / 1e9,
    )
