"""fp32 matmuls on CPU: oneDNN's against MKL's (`F.linear`), A/B in one process, per layer
shape and end to end (engine/model/dense_matmul.py).

    python -m bench.fp32_matmul [--tokens 1 4 16 64 256 1024] [--rounds 3]
        [--num-prompts 16] [--prompt-tokens 32 96]

1. Each of SmolLM2's projection shapes at each token count: the median time of MKL and of
   oneDNN, interleaved, their ratio, and the crossover the engine measures for the shape.
2. A burst of NUM_PROMPTS prompts (seeded lengths from PROMPT_TOKENS, greedy, 16 tokens
   each, prefix caching off) into an idle fp32 engine, the shape of a stream resume's
   continuations; rounds alternate between `before` (every product through `F.linear`) and
   `after` (the engine's choice) on one engine.
Prints TTFT p50/max and drain time per round with the before / after ratios; the load average
and CPU flags beside them.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from unittest import mock

import torch
import torch.nn.functional as F

from bench.prefill_burst import ab_bursts, add_burst_arguments, seeded_prompts
from bench.report import load_average, machine, report_out
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import dense_matmul
from engine.model_store import DEFAULT_MODEL, pull

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def layer_table(token_counts: list[int]) -> list[dict[str, float | int | str | None]]:
    rows: list[dict[str, float | int | str | None]] = []
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k)
        for tokens in token_counts:
            x = torch.randn(tokens, k)
            mkl, onednn = [], []
            for _ in range(5):
                mkl.append(dense_matmul.median_s(functools.partial(F.linear, x, weight)))
                onednn_linear = functools.partial(dense_matmul._onednn_linear, x, weight)
                onednn.append(dense_matmul.median_s(onednn_linear))
            mkl_s, onednn_s = statistics.median(mkl), statistics.median(onednn)
            times = {"mkl_ms": mkl_s * 1e3, "onednn_ms": onednn_s * 1e3}
            rows.append({"shape": name, "tokens": tokens, **times})
            print(
                f"{name:8} {tokens:5} tokens: MKL {mkl_s * 1e3:7.3f} ms, oneDNN "
                f"{onednn_s * 1e3:7.3f} ms, MKL / oneDNN {mkl_s / onednn_s:.2f}x",
                flush=True,
            )
        crossover = dense_matmul.onednn_min_tokens(n, k)
        rows.append({"shape": name, "crossover_tokens": crossover})
        print(f"{name:8} the engine's choice: oneDNN from {crossover} tokens (None: never)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    add_burst_arguments(parser, [32, 96])
    args = parser.parse_args(argv)
    if not dense_matmul._ONEDNN:
        raise SystemExit("fp32_matmul: this torch has no oneDNN")
    load_before = load_average()
    table = layer_table(args.tokens)
    model = str(pull(DEFAULT_MODEL))

    print("a burst into an fp32 engine: MKL (before) against the measured choice (after)")
    fp32 = LLMEngine(EngineConfig(model, dtype="float32", enable_prefix_caching=False))
    prompts = seeded_prompts(args.num_prompts, args.prompt_tokens)
    mkl_only = mock.patch.object(dense_matmul, "onednn_min_tokens", lambda n, k: None)
    matmul_rounds = ab_bursts(fp32, lambda: prompts, mkl_only, args.rounds, max_tokens=16)
    report = {
        "layers": table,
        "num_prompt_tokens": sum(map(len, prompts)),
        "rounds": matmul_rounds,
        **machine(load_before),
    }
    report_out(report, args.json, ("load_average", "cpu_flags"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
