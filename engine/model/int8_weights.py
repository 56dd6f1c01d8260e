"""Weight-only int8 matmuls on CPU: each weight row kept as int8 with one scale.

A decode step reads every weight once, so its time is the bytes it reads: int8 reads a quarter
of fp32's (the dtype CPUs without AVX-512 BF16 compute in) and half of bf16's. torch's
`_weight_int8pack_mm` multiplies by the int8 rows directly and is the fast path for steps of
few tokens; it is not a tiled GEMM, so a step of many tokens (a prefill chunk) is faster
dequantizing the weight first and running the ordinary matmul. Where the two cross depends on
the CPU, so it is measured once per process (`measure_max_gemv_tokens`).

bf16 weights (no int8) go to `dense_linear`, which takes our GEMV kernel for steps of few
tokens (engine/model/dense_matmul.py). An int8 twin of that kernel was no faster than
`_weight_int8pack_mm` and was dropped.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from engine.model.block_weights import BlockWeight
from engine.model.dense_matmul import dense_linear, median_s

logger = logging.getLogger(__name__)

_PROBE_TOKENS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(slots=True)
class Int8Weight:
    qweight: torch.Tensor  # (N, K) int8: round(w / scale), in [-127, 127]
    scales: torch.Tensor  # (N,) in the model's dtype: max |w| of the row / 127
    max_gemv_tokens: int  # steps of up to this many tokens multiply by the int8 rows

    @classmethod
    def quantize(cls, weight: torch.Tensor, max_gemv_tokens: int) -> Int8Weight:
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        qweight = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(qweight, scales.to(weight.dtype), max_gemv_tokens)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) -> x W^T (T, N)."""
        if x.shape[0] <= self.max_gemv_tokens:
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        return dense_linear(x, self.dequantized())

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's (N, K)."""
        return self.qweight.shape[0], self.qweight.shape[1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` (T,) -> (T, K): an embedding lookup."""
        return self.qweight[ids].to(self.scales.dtype) * self.scales[ids, None]

    def dequantized(self) -> torch.Tensor:
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quantized: Int8Weight | BlockWeight | None,
) -> torch.Tensor:
    """F.linear, through the int8 or block weight where the layer holds one."""
    if quantized is None:
        return dense_linear(x, weight, bias)
    out = quantized.linear(x)
    return out if bias is None else out + bias


@functools.cache
def measure_max_gemv_tokens(in_features: int, out_features: int, dtype: torch.dtype) -> int:
    """The largest step (in tokens, among a few probes) for which the int8 matmul beats
    dequantizing and the ordinary one, on a layer of this shape on this CPU."""
    weight = Int8Weight.quantize(torch.randn(out_features, in_features, dtype=dtype), 0)
    best = 0
    for num_tokens in _PROBE_TOKENS:
        x = torch.randn(num_tokens, in_features, dtype=dtype)
        weight.max_gemv_tokens = num_tokens
        int8_s = median_s(functools.partial(weight.linear, x))
        dequant_s = median_s(functools.partial(_dequantized_linear, x, weight))
        if int8_s > dequant_s:
            break
        best = num_tokens
    logger.info(
        "int8 weights: the int8 matmul for steps of up to %d tokens, dequantized above", best
    )
    return best


def _dequantized_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    return dense_linear(x, weight.dequantized())
