"""Block-quantized weights kept as the GGUF stores them (Q4_1, Q8_0), read by our GEMV kernel.

A decode step reads every weight once, so its time is the bytes it reads, or the instructions
that turn them into weights. llama.cpp keeps each row as blocks of 32 weights:
- Q4_1: an fp16 scale d, an fp16 min m and 16 bytes of nibbles (weight j in the low nibble of
  byte j, weight j + 16 in the high one), w = d * q + m: 20 bytes per 32 weights;
- Q8_0: an fp16 scale d and 32 int8 q, w = d * q: 34 bytes per 32 weights;
against 64 in bf16. At load the fp16 scales are widened to fp32 (exact: every fp16 is an fp32)
and the quants kept as they are (24 and 36 bytes a block): the kernel is bound by its
instructions, and converting fp16 scales in its loop cost more than the bytes they save. So the
model multiplies by the file's own weights, with no re-quantization: only the order of the
fp32 sums differs from the dequantized model.

`quantization="q4_1"` keeps the projections as Q4_1 (model/llama.py) and the tied LM head of the
default file, Q8_0 there, as Q8_0 (model/parallel_layers.py). Steps of few tokens run the
format's kernel (`q4_1_linear`, `q8_0_linear` in engine/kernels/gemv_cpu.cpp); steps of more
tokens (`BlockWeight.max_kernel_tokens`) dequantize the layer to the model's dtype and run the
dense matmul (`dense_matmul.py`), as does every step where the kernels are off
(`MERIDIAN_CPU_KERNELS=0`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from engine.errors import InvalidRequestError
from engine.kernels import cpu_kernels
from engine.model.dense_matmul import dense_linear, packed

BLOCK_WEIGHTS = 32
# Steps of up to this many tokens read the blocks; above, oneDNN multiplies the dequantized weight,
# packed (`dense_for`). The blocks' loop takes 4 tokens at a time, so its cost grows with the
# tokens, where oneDNN's GEMM is built for many. On the AMD EPYC (AVX-512 BF16, no AMX;
# bench/engine_step.py at dc8df86, `q4_1` against `q4_1-gemv-4`, 2026-12-07) a decode step of 32
# sequences ran 1.03-1.08x faster with the packed weight above 16 tokens than with the blocks up to
# 64 (the range the bf16 GEMV's probes gave them before), though alone the blocks beat the packed
# weight on 2 of SmolLM2's 4 shapes at 32 tokens and on 3 at 64 (bench/linear_small_m.py).
GEMV_MAX_TOKENS = 16
# Where the kernels multiply bf16 steps of 2 or more tokens on AMX tiles (a Sapphire Rapids:
# engine/kernels/amx_cpu.cpp), dequantizing is their cost at any step of up to 32 tokens (one
# pass of the tiles), and they beat oneDNN's AMX GEMM on the dense weight there (1.3-2.7x on
# SmolLM2's shapes, the LM head's too); at 48 and 64 the tiles' two passes lost to it.
AMX_BLOCKS_MAX_TOKENS = 32
# The LM head, whose float rows the model keeps too (packed for oneDNN: model/parallel_layers.py),
# reads its blocks up to 4 tokens: above, the packed rows were faster (the Q8_0 blocks against
# them, AMD EPYC, 2 threads: 1.8 against 2.8 ms at 1 token, 2.0 against 2.5 at 4, 3.5 against
# 2.4 at 8).
HEAD_BLOCKS_MAX_TOKENS = 4


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str  # "q4_1": the kernels' ops are q4_1_linear and q4_1_dequantize
    gguf_type: str  # GGMLQuantizationType's name: "Q4_1"
    num_scales: int  # fp32 scales at the front of a block (d, or d and m)
    num_quant_bytes: int  # the quants after them

    @property
    def block_bytes(self) -> int:
        return 4 * self.num_scales + self.num_quant_bytes

    @property
    def file_block_bytes(self) -> int:
        """A block as the GGUF stores it, its scales fp16."""
        return 2 * self.num_scales + self.num_quant_bytes


Q4_1 = BlockFormat("q4_1", "Q4_1", num_scales=2, num_quant_bytes=16)
Q8_0 = BlockFormat("q8_0", "Q8_0", num_scales=1, num_quant_bytes=32)
FORMATS = {f.gguf_type: f for f in (Q4_1, Q8_0)}


def widen_scales(file_blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Rows of blocks as the GGUF stores them (N, K / 32 * file bytes) -> as the kernel reads
    them (N, K / 32 * block bytes): each fp16 scale widened to fp32, the quants unchanged."""
    num_rows = file_blocks.shape[0]
    blocks = file_blocks.reshape(num_rows, -1, fmt.file_block_bytes)
    scale_bytes = 2 * fmt.num_scales
    scales = blocks[..., :scale_bytes].contiguous().view(torch.float16).float()
    return torch.cat((scales.view(torch.uint8), blocks[..., scale_bytes:]), dim=-1).reshape(
        num_rows, -1
    )


@dataclass(slots=True)
class BlockWeight:
    blocks: torch.Tensor  # (N, K / 32 * block bytes) uint8: each row's blocks, scales fp32
    format: BlockFormat
    dtype: torch.dtype  # the model's: what x, the output and a dequantized weight are in
    float_rows_kept: bool = False  # the model keeps the weight in its dtype too (the LM head)
    # max_kernel_tokens, worked out at the first step: every linear call asks for it.
    _max_kernel_tokens: int = field(default=0, init=False, repr=False, compare=False)
    # The dequantized weight, kept from the first dense step on the CPU: dequantizing the layer
    # cost about as much as its matmul at 26 tokens (a cached prefix's step), at every step.
    _dense: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def empty(
        cls,
        fmt: BlockFormat,
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
        float_rows_kept: bool = False,
    ) -> BlockWeight:
        if in_features % BLOCK_WEIGHTS:
            raise InvalidRequestError(
                f"{fmt.gguf_type} weights: a row of {in_features} weights is not whole blocks "
                f"of {BLOCK_WEIGHTS}"
            )
        row_bytes = in_features // BLOCK_WEIGHTS * fmt.block_bytes
        blocks = torch.zeros(out_features, row_bytes, dtype=torch.uint8)
        return cls(blocks, fmt, dtype, float_rows_kept)

    @classmethod
    def from_gguf(
        cls, file_blocks: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype
    ) -> BlockWeight:
        return cls(widen_scales(file_blocks, fmt), fmt, dtype)

    def kernels_for(self, x: torch.Tensor) -> ModuleType | None:
        """The kernels' module where this step of x reads the blocks, else None."""
        on_cpu = x.device.type == "cpu"
        if on_cpu and (k := cpu_kernels()) and x.shape[0] <= self.max_kernel_tokens():
            return k
        return None

    def max_kernel_tokens(self) -> int:
        """Steps of up to this many tokens read the blocks (GEMV_MAX_TOKENS); bigger ones the
        dense weight. On AMX tiles, up to AMX_BLOCKS_MAX_TOKENS; the LM head's, up to
        HEAD_BLOCKS_MAX_TOKENS."""
        if not self._max_kernel_tokens:
            self._max_kernel_tokens = self._kernel_range()
        return self._max_kernel_tokens

    def _kernel_range(self) -> int:
        if self.dtype == torch.bfloat16 and (k := cpu_kernels()) and k.amx_tiles_ready():
            return AMX_BLOCKS_MAX_TOKENS
        if self.dtype != torch.bfloat16:
            return GEMV_MAX_TOKENS
        return HEAD_BLOCKS_MAX_TOKENS if self.float_rows_kept else GEMV_MAX_TOKENS

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) -> x W^T (T, N)."""
        if k := self.kernels_for(x):
            return getattr(k, f"{self.format.name}_linear")(x.contiguous(), self.blocks)
        return dense_linear(x, self.dense_for(x))

    def dense_for(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized weight for a dense step of x: kept on the CPU (host memory, ~2.7x the
        blocks' bytes, bought back from every prefill step), bf16 in oneDNN's own layout
        (`packed`); made each step on an accelerator, where dequantizing is cheap and its
        memory went to the KV cache at load."""
        if x.device.type != "cpu":
            return self.dequantized()
        if self._dense is None:
            self._dense = packed(self.dequantized())
        return self._dense

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] // self.format.block_bytes * BLOCK_WEIGHTS

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's (N, K)."""
        return self.blocks.shape[0], self.in_features

    def dequantized(self) -> torch.Tensor:
        """The weight (N, K) in the model's dtype: each weight computed in fp32 as gguf's
        dequantizer does (Q4_1: d * q, then + m), then rounded once to the dtype."""
        if self.blocks.device.type == "cpu" and (k := cpu_kernels()):
            # 13-36x the eager twin below (Q4_1 3072x576 in bf16: 1.9 against 25 ms, 1 thread).
            dequantize = getattr(k, f"{self.format.name}_dequantize")
            return dequantize(self.blocks, self.in_features, self.dtype)
        num_rows, fmt = self.blocks.shape[0], self.format
        blocks = self.blocks.view(num_rows, -1, fmt.block_bytes)
        scales = blocks[..., : 4 * fmt.num_scales].contiguous().view(torch.float32)
        quants = blocks[..., 4 * fmt.num_scales :]
        if fmt is Q8_0:
            weights = quants.view(torch.int8).float() * scales
        else:
            q = torch.cat((quants & 0x0F, quants >> 4), dim=-1).float()  # (N, blocks, 32)
            weights = torch.addcmul(scales[..., 1:2], q, scales[..., 0:1])
        return weights.reshape(num_rows, -1).to(self.dtype)

    def columns(self, start: int, stop: int) -> torch.Tensor:
        """Blocks of input columns [start, stop) of every row, for a row-parallel shard."""
        if start % BLOCK_WEIGHTS or stop % BLOCK_WEIGHTS:
            raise InvalidRequestError(
                f"{self.format.gguf_type} weights: a tensor-parallel shard of input columns "
                f"{start}-{stop} does not fall on blocks of {BLOCK_WEIGHTS}; use fewer ranks"
            )
        blocks = self.blocks.view(self.blocks.shape[0], -1, self.format.block_bytes)
        part = blocks[:, start // BLOCK_WEIGHTS : stop // BLOCK_WEIGHTS]
        return part.reshape(self.blocks.shape[0], -1)
