"""fp32 matmuls on CPU: MKL's (`F.linear`) against oneDNN's, A/B in one process, per layer shape
and end to end (engine/model/dense_matmul.py).

    python -m bench.fp32_matmul [--tokens 1 4 16 64 256 1024] [--num-prompts 16]
        [--prompt-tokens 32 96] [--rounds 3]

1. Each of SmolLM2's projection shapes at each token count: the median time of MKL and of
   oneDNN, interleaved, and their ratio; then the crossover the engine measured for it.
2. A burst of NUM_PROMPTS prompts (seeded lengths from PROMPT_TOKENS, greedy, 16 tokens each,
   prefix caching off) into an idle fp32 engine: the shape of a stream resume's continuations.
   Rounds alternate between `mkl` (every product through `F.linear`) and `measured` (the
   engine's choice), on one engine. Prints TTFT p50/max and drain time per round and their
   ratios; the load average and CPU flags beside them.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F

from bench.engine_throughput import cpu_vector_flags, load_average
from bench.prefill_burst import run_burst
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
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[32, 96])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not dense_matmul._ONEDNN:
        raise SystemExit("fp32_matmul: this torch has no oneDNN")
    load_before = load_average()
    table = layer_table(args.tokens)

    config = EngineConfig(str(pull(DEFAULT_MODEL)), dtype="float32", enable_prefix_caching=False)
    engine = LLMEngine(config)
    rng = random.Random(0)
    prompts = [
        [100 + rng.randrange(40_000) for _ in range(rng.randint(*args.prompt_tokens))]
        for _ in range(args.num_prompts)
    ]
    mkl_only = mock.patch.object(dense_matmul, "onednn_min_tokens", lambda k, n: None)
    run_burst(engine, prompts, 2)  # warm up both paths' shapes
    with mkl_only:
        run_burst(engine, prompts, 2)
    rounds = []
    for r in range(args.rounds):
        order = ["mkl", "measured"] if r % 2 == 0 else ["measured", "mkl"]
        results = {}
        for name in order:
            with mkl_only if name == "mkl" else nullcontext():
                results[name] = run_burst(engine, prompts, 16)
        rounds.append(results)
        mkl, ours = results["mkl"], results["measured"]
        print(
            f"round {r + 1}: TTFT p50 / max  MKL {mkl['ttft_p50_s']:.3f} / "
            f"{mkl['ttft_max_s']:.3f} s,"
            f" measured {ours['ttft_p50_s']:.3f} / {ours['ttft_max_s']:.3f} s"
            f" ({mkl['ttft_max_s'] / ours['ttft_max_s']:.2f}x);  drain {mkl['drain_s']:.2f} /"
            f" {ours['drain_s']:.2f} s ({mkl['drain_s'] / ours['drain_s']:.2f}x)",
            flush=True,
        )
    report = {
        "layers": table,
        "num_prompt_tokens": sum(len(p) for p in prompts),
        "rounds": rounds,
        "load_average": [load_before, load_average()],
        "cpu_flags": cpu_vector_flags(),
    }
    print(json.dumps({k: report[k] for k in ("num_prompt_tokens", "load_average", "cpu_flags")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
