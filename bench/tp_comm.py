"""Tensor-parallel communication cost: time rank 0 spends in collectives over its step time.

    python -m bench.tp_comm [--tp 1 3] [--num-requests 16] [--max-tokens 64]

On a CPU the ranks share the same cores, so TP cannot speed anything up here; what this
records is the price of the all-reduces (two per layer) and the logits all-gather per step.
SmolLM2 has 9 attention heads and 3 KV heads, so its valid sizes are 1, 3 and 9.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.workload import make_workload
from engine.config import EngineConfig
from engine.distributed import TPGroup
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.model_store import DEFAULT_MODEL, pull
from engine.sampling_params import SamplingParams


class CollectiveClock:
    """Wraps TPGroup's collectives in this process to add up the time spent in them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def timed(group: TPGroup, x: torch.Tensor) -> torch.Tensor:
            if group.size == 1:
                return method(group, x)
            started = time.perf_counter()
            try:
                return method(group, x)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        return timed


def measure(tp_size: int, num_requests: int, max_tokens: int, dtype: str) -> dict[str, Any]:
    gguf = pull(DEFAULT_MODEL)
    engine = LLMEngine(
        EngineConfig(
            model=str(gguf), dtype=dtype, tensor_parallel_size=tp_size, cpu_kv_cache_gib=0.5
        )
    )
    workload = make_workload(
        num_requests,
        0,
        load_checkpoint(gguf).tokenizer,
        prompt_tokens=(64, 256),
        output_tokens=(max_tokens, max_tokens),
    )
    clock = CollectiveClock()
    originals = (TPGroup.all_reduce, TPGroup.all_gather_last_dim)
    TPGroup.all_reduce = clock.wrap(originals[0])  # type: ignore[method-assign]
    TPGroup.all_gather_last_dim = clock.wrap(originals[1])  # type: ignore[method-assign]
    try:
        for i, request in enumerate(workload):
            engine.add_request(
                str(i),
                list(request.prompt_token_ids),
                SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            )
        steps, step_seconds = 0, 0.0
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            step_seconds += time.perf_counter() - started
            steps += 1
    finally:
        TPGroup.all_reduce, TPGroup.all_gather_last_dim = originals  # type: ignore[method-assign]
        engine.shutdown()
    return {
        "tp": tp_size,
        "steps": steps,
        "step_ms": round(step_seconds / steps * 1000, 2),
        "collective_ms_per_step": round(clock.seconds / steps * 1000, 2),
        "collectives_per_step": round(clock.calls / steps, 1),
        "communication_share": round(clock.seconds / step_seconds, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for tp in args.tp:
        print(f"TP {tp}...", file=sys.stderr, flush=True)
        rows.append(measure(tp, args.num_requests, args.max_tokens, args.dtype))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'TP':>3} {'steps':>6} {'step ms':>8} {'in collectives ms':>18} {'share':>6}")
    for r in rows:
        print(
            f"{r['tp']:>3} {r['steps']:>6} {r['step_ms']:>8} {r['collective_ms_per_step']:>18} "
            f"{r['communication_share']:>6.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
