"""Matmuls of a few tokens on the model's layer shapes: torch's paths against our bf16 GEMV
and block (Q4_1, Q8_0) GEMV kernels, in one process.

    python -m bench.linear_small_m [--tokens 1 4 8] [--threads 1 2] [--repeats 50]

For each shape of SmolLM2-135M (fused QKV, O, fused gate-up, down, the tied LM head), token
count and thread count, times `F.linear` on bf16 weights, our `bf16_linear`, and torch's
`_weight_int8pack_mm` on per-row int8 weights (what `quantization="int8"` runs), and our block
kernel on random blocks in the format `quantization="q4_1"` keeps the layer in (Q4_1, the LM head
Q8_0; fp32 scales as at load), and the same blocks dequantized and multiplied by our bf16 kernel
(what a q4_1 step of 9-64 tokens ran before the blocks' kernel dequantized in L1). Each call
reads a different copy of the weight, cycling through enough copies to exceed 256 MB, so the
weights come from memory as in a decode step, not from a cache that one repeated call keeps warm.
Prints the median microseconds per call, F.linear's time over ours, ours over int8pack's and
ours bf16 over the block kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from bench.report import load_average, machine, report_out
from engine.kernels import cpu_kernels
from engine.model.block_weights import Q4_1, Q8_0, BlockFormat, BlockWeight
from engine.model.dense_matmul import dense_linear, packed
from engine.model.int8_weights import Int8Weight

SHAPES = {  # (out_features, in_features)
    "qkv 960x576": (960, 576),
    "o 576x576": (576, 576),
    "gate-up 3072x576": (3072, 576),
    "down 576x1536": (576, 1536),
    "lm-head 49152x576": (49152, 576),
}
_CYCLE_BYTES = 256 * 2**20


def random_blocks(n: int, k: int, fmt: BlockFormat) -> BlockWeight:
    """Blocks of any quants, with scales (and mins) of a real layer's size."""
    num_blocks = n * k // 32
    parts = [(torch.rand(num_blocks, 1) * 0.02).half().view(torch.uint8)]
    if fmt is Q4_1:
        parts.append((-torch.rand(num_blocks, 1) * 0.1).half().view(torch.uint8))
    parts.append(torch.randint(0, 256, (num_blocks, fmt.num_quant_bytes), dtype=torch.uint8))
    file_blocks = torch.cat(parts, dim=1).reshape(n, -1)
    return BlockWeight.from_gguf(file_blocks, fmt, torch.bfloat16)


def _median_us(calls: list[Callable[[], object]], repeats: int) -> float:
    for call in calls[:2]:
        call()
    times = []
    for i in range(repeats):
        call = calls[i % len(calls)]
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def time_shape(n: int, k: int, num_tokens: int, repeats: int) -> dict[str, float]:
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build (MERIDIAN_CPU_KERNELS=0?)"
    copies = max(2, -(-_CYCLE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(copies)]
    int8 = [Int8Weight.quantize(w, max_gemv_tokens=64) for w in weights]
    x = torch.randn(num_tokens, k, dtype=torch.bfloat16)
    fmt = Q8_0 if (n, k) == SHAPES["lm-head 49152x576"] else Q4_1
    blocks = [random_blocks(n, k, fmt) for _ in range(copies)]
    block_linear = getattr(kernels, f"{fmt.name}_linear")
    int8pack = torch.ops.aten._weight_int8pack_mm
    paths: dict[str, list[Callable[[], object]]] = {
        "F.linear bf16": [partial(F.linear, x, w) for w in weights],
        # The dense path of the engine's block weights: the weight packed once for oneDNN.
        "packed bf16": [partial(dense_linear, x, packed(w)) for w in weights],
        "ours bf16": [partial(kernels.bf16_linear, x, w) for w in weights],
        "int8pack": [partial(int8pack, x, q.qweight, q.scales) for q in int8],
        "ours blocks": [partial(block_linear, x, b.blocks) for b in blocks],
        # What the engine ran above the blocks' range before they dequantized in L1.
        "dequantized + ours bf16": [
            partial(lambda b: kernels.bf16_linear(x, b.dequantized()), b) for b in blocks
        ],
    }
    return {name: _median_us(calls, repeats) for name, calls in paths.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    load_before, rows = load_average(), []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape, (n, k) in SHAPES.items():
            for num_tokens in args.tokens:
                us = time_shape(n, k, num_tokens, args.repeats)
                rows.append({"shape": shape, "tokens": num_tokens, "threads": threads, "us": us})
                print(
                    f"{shape:18} M={num_tokens} threads={threads}  "
                    + "  ".join(f"{name} {t:7.0f} us" for name, t in us.items())
                    + f"  | F.linear / ours {us['F.linear bf16'] / us['ours bf16']:.2f}x"
                    + f"  ours / int8pack {us['ours bf16'] / us['int8pack']:.2f}x"
                    + f"  ours bf16 / blocks {us['ours bf16'] / us['ours blocks']:.2f}x",
                    flush=True,
                )
    report = {
        "rows": rows,
        **machine(load_before),
    }
    report_out(report, args.json, ("load_average", "cpu_flags"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
