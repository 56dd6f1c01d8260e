"""Prefill attention on CPU: the paged kernel (engine/kernels/prefill_attention_cpu.cpp) against
the portable path (context gathered, torch's SDPA with a mask), A/B in one process.

    python -m bench.prefill_attention [--rounds 3] [--num-prompts 16]
        [--prompt-tokens 256 768]

1. One layer's attention (SmolLM2's 9 query heads over 3 KV heads of 64) for chunks of
   `tokens` queries after `context` cached keys, bf16 and fp32: the median time of each path,
   interleaved, their ratio, and the kernel's useful GFLOP/s (causal scores only).
2. A burst of NUM_PROMPTS prompts (seeded lengths from PROMPT_TOKENS, greedy, 16 tokens each,
   prefix caching off) into the idle default engine, the shape of the prompt-heavy workload;
   rounds alternate between `before` (the portable path) and `after` (the kernel) on one engine.
Prints TTFT p50/max and drain time per round with the before / after ratios; the load average
and CPU flags beside them.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from unittest import mock

import torch

from bench.prefill_burst import ab_bursts, add_burst_arguments, seeded_prompts
from bench.report import load_average, machine, report_out
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import attention
from engine.model.attention import AttentionMetadata, PrefillChunk, paged_attention
from engine.model.dense_matmul import median_s
from engine.model_runner import prefill_mask
from engine.model_store import DEFAULT_MODEL, pull

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# (tokens, context): a whole prompt, chunks of a long one, a continuation after a long context.
SHAPES = [(64, 0), (512, 0), (512, 256), (256, 512), (512, 512), (64, 960)]
PORTABLE = mock.patch.object(attention, "paged_prefill_kernel", lambda device, head_dim: None)


def layer_table(dtype: torch.dtype) -> list[dict[str, float | int | str]]:
    rows: list[dict[str, float | int | str]] = []
    for tokens, context in SHAPES:
        num_blocks = -(-(tokens + context) // BLOCK_SIZE)
        cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        k_cache, v_cache = torch.randn(cache_shape).to(dtype), torch.randn(cache_shape).to(dtype)
        block_ids = torch.randperm(num_blocks)
        q = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
        positions = torch.arange(context, context + tokens)
        slots = block_ids[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        k = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        v = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        chunk = PrefillChunk(0, tokens, context, block_ids, prefill_mask(context, tokens))
        empty = torch.empty(0, dtype=torch.long)
        meta = AttentionMetadata(slots, 0, empty, empty, None, [chunk])
        call = functools.partial(paged_attention, q, k, v, k_cache, v_cache, meta)
        portable, kernel = [], []
        for _ in range(5):
            with PORTABLE:
                portable.append(median_s(call))
            kernel.append(median_s(call))
        portable_s, kernel_s = statistics.median(portable), statistics.median(kernel)
        gflops = 4 * HEADS * HEAD_DIM * (tokens * context + tokens * (tokens + 1) / 2) / 1e9
        rows.append({
            "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "context": context,
            "portable_ms": portable_s * 1e3, "kernel_ms": kernel_s * 1e3,
            "kernel_gflop_s": gflops / kernel_s,
        })  # fmt: skip
        print(
            f"{rows[-1]['dtype']:8} {tokens:4} tokens after {context:4}: portable "
            f"{portable_s * 1e3:6.2f} ms, kernel {kernel_s * 1e3:6.2f} ms "
            f"({portable_s / kernel_s:.2f}x, {gflops / kernel_s:.0f} GFLOP/s)",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_burst_arguments(parser, [256, 768])
    args = parser.parse_args(argv)
    if attention.paged_prefill_kernel(torch.device("cpu"), HEAD_DIM) is None:
        raise SystemExit("prefill_attention: no prefill kernel on this CPU (it needs AVX-512)")
    load_before = load_average()
    table = [row for dtype in (torch.bfloat16, torch.float32) for row in layer_table(dtype)]

    print("a burst into the default engine: the portable path (before) against the kernel")
    engine = LLMEngine(EngineConfig(str(pull(DEFAULT_MODEL)), enable_prefix_caching=False))
    prompts = seeded_prompts(args.num_prompts, args.prompt_tokens)
    rounds = ab_bursts(engine, lambda: prompts, PORTABLE, args.rounds, max_tokens=16)
    report = {
        "layers": table,
        "num_prompt_tokens": sum(map(len, prompts)),
        "rounds": rounds,
        **machine(load_before),
    }
    report_out(report, args.json, ("num_prompt_tokens", "load_average", "cpu_flags"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
