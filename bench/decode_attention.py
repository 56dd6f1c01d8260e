"""Decode attention over the paged KV cache, one layer's call, A/B in one process: our CPU
kernel against the portable path it replaces (gather the blocks, then PyTorch's SDPA), calls
alternating on the same inputs.

    python -m bench.decode_attention [--threads 1] [--calls 20] [--kv-cache-dtype fp8]

Shapes are SmolLM2-135M's (9 query heads over 3 KV heads of 64, bf16, blocks of 16 tokens), at
batch sizes and contexts a decode step meets. Prints the median time per call of each, the
ratio, and the KV bytes read per second by the kernel; the load average and CPU flags beside.
With `--kv-cache-dtype fp8`, the kernel on the bf16 cache against the kernel on the same values
kept in fp8 (engine/model/kv_quant.py) instead: the bytes per second are then the fp8 cache's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from bench.report import cpu_vector_flags, load_average
from engine.kernels import cpu_kernels
from engine.model.attention import AttentionMetadata, _decode_attention
from engine.model.kv_quant import quantize

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CASES = ((1, 256), (1, 1024), (4, 512), (32, 128), (32, 512))  # (batch, context tokens)


def metadata(batch: int, context: int, with_mask: bool) -> AttentionMetadata:
    blocks = -(-context // BLOCK_SIZE)
    tables = torch.randperm(batch * blocks, generator=torch.Generator().manual_seed(0))
    lens = torch.full((batch,), context, dtype=torch.int64)
    mask = None
    if with_mask:
        mask = (torch.arange(blocks * BLOCK_SIZE)[None, :] < lens[:, None])[:, None, None, :]
    empty = torch.empty(0, dtype=torch.long)
    return AttentionMetadata(empty, batch, tables.view(batch, blocks), lens, mask, [])


def median_ms(call: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    args = parser.parse_args(argv)
    if cpu_kernels() is None:
        print("the CPU kernels could not be built here: nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    print(f"CPU flags: {' '.join(cpu_vector_flags())}; load average {load_average()} before")
    fp8 = args.kv_cache_dtype == "fp8"
    base_name, ours_name = ("kernel", "fp8") if fp8 else ("portable", "kernel")
    print(f"{'batch':>5} {'context':>7} {base_name:>10} {ours_name:>10} {'ratio':>7} {'GB/s':>6}")
    gen = torch.Generator().manual_seed(1)
    for batch, context in CASES:
        num_blocks = batch * -(-context // BLOCK_SIZE)
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        k_cache, v_cache = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in "kv")
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        with_kernel, portable = metadata(batch, context, False), metadata(batch, context, True)
        variants = {
            "portable": (portable, k_cache, v_cache),
            "kernel": (with_kernel, k_cache, v_cache),
        }
        if fp8:
            variants = {"kernel": variants["kernel"],
                        "fp8": (with_kernel, quantize(k_cache), quantize(v_cache))}  # fmt: skip
        ms: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(3):  # alternate, so that the load falls on both alike
            for name, (meta, keys, values) in variants.items():
                call = partial(_decode_attention, q, keys, values, meta)
                ms[name].append(median_ms(call, args.calls))
        base, ours = statistics.median(ms[base_name]), statistics.median(ms[ours_name])
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
        print(
            f"{batch:>5} {context:>7} {base:>8.3f}ms {ours:>8.3f}ms {base / ours:>6.2f}x "
            f"{kv_bytes / ours / 1e6:>6.1f}"
        )
    print(f"load average {load_average()} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
