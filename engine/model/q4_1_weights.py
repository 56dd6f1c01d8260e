"""Q4_1 weights kept as the GGUF stores them: 4 bits a weight, read by our GEMV kernel.

A decode step reads every weight once, so its time is the bytes it reads. llama.cpp's Q4_1 keeps
each row as blocks of 32 weights: an fp16 scale d, an fp16 min m and 16 bytes of nibbles (weight
j in the low nibble of byte j, weight j + 16 in the high one), w = d * q + m: 20 bytes per 32
weights, against 64 in bf16. Keeping the blocks (`quantization="q4_1"`) multiplies by the file's
own weights, with no re-quantization: only the order of the fp32 sums differs from the
dequantized model.

Steps of few tokens run `q4_1_linear` (engine/kernels/gemv_cpu.cpp); steps of more tokens (a
prefill chunk) dequantize the layer to the model's dtype and run `F.linear`, as does every step
where the kernels are off (`MERIDIAN_CPU_KERNELS=0`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.errors import InvalidRequestError
from engine.kernels import cpu_kernels

BLOCK_WEIGHTS = 32
BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
# Steps of up to this many tokens take the kernel. It reads a row's blocks once per 4 tokens,
# so its cost grows with the tokens, while dequantizing costs the same at any step size; they
# crossed between 16 and 32 tokens on the model's shapes (see docs/benchmarks.md).
Q4_1_GEMV_MAX_TOKENS = 16


@dataclass(slots=True)
class Q4_1Weight:
    blocks: torch.Tensor  # (N, K / 32 * 20) uint8: each row's Q4_1 blocks, as in the file
    dtype: torch.dtype  # the model's: what x, the output and a dequantized weight are in

    @classmethod
    def empty(cls, out_features: int, in_features: int, dtype: torch.dtype) -> Q4_1Weight:
        if in_features % BLOCK_WEIGHTS:
            raise InvalidRequestError(
                f"quantization q4_1: a row of {in_features} weights is not whole Q4_1 blocks "
                f"of {BLOCK_WEIGHTS}"
            )
        row_bytes = in_features // BLOCK_WEIGHTS * BLOCK_BYTES
        return cls(torch.zeros(out_features, row_bytes, dtype=torch.uint8), dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) -> x W^T (T, N)."""
        if x.shape[0] <= Q4_1_GEMV_MAX_TOKENS and x.device.type == "cpu" and (k := cpu_kernels()):
            return k.q4_1_linear(x.contiguous(), self.blocks)
        return F.linear(x, self.dequantized())

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] // BLOCK_BYTES * BLOCK_WEIGHTS

    def dequantized(self) -> torch.Tensor:
        """The weight (N, K) in the model's dtype: each d * q + m computed in fp32 as gguf's
        dequantizer does, then rounded once to the dtype."""
        if self.blocks.device.type == "cpu" and (k := cpu_kernels()):
            # 13-36x the eager twin below (3072x576 in bf16: 1.9 against 25 ms at one thread).
            return k.q4_1_dequantize(self.blocks, self.in_features, self.dtype)
        num_rows = self.blocks.shape[0]
        blocks = self.blocks.view(num_rows, -1, BLOCK_BYTES)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (N, blocks, 1)
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        nibbles = blocks[..., 4:]
        q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).float()  # (N, blocks, 32)
        return torch.addcmul(m, q, d).reshape(num_rows, -1).to(self.dtype)

    def columns(self, start: int, stop: int) -> torch.Tensor:
        """Blocks of input columns [start, stop) of every row, for a row-parallel shard."""
        if start % BLOCK_WEIGHTS or stop % BLOCK_WEIGHTS:
            raise InvalidRequestError(
                f"quantization q4_1: a tensor-parallel shard of input columns {start}-{stop} "
                f"does not fall on Q4_1 blocks of {BLOCK_WEIGHTS}; use fewer ranks"
            )
        blocks = self.blocks.view(self.blocks.shape[0], -1, BLOCK_BYTES)
        part = blocks[:, start // BLOCK_WEIGHTS : stop // BLOCK_WEIGHTS]
        return part.reshape(self.blocks.shape[0], -1)
