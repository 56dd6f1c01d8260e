"""Parallel communication cost: the share of rank 0's time spent communicating.

    python -m bench.parallel_comm [--layouts 1x1 3x1 1x2] [--num-requests 16] [--max-tokens 64]
                                  [--model NAME_OR_PATH]

A layout is TPxPP: `3x1` is tensor parallelism over 3 ranks, `1x2` a pipeline of 2 stages. For
TP the driver's communication is the all-reduces (two per layer) and the logits all-gather;
for PP it is the wait for the last stage's logits, which covers the activations' trip down the
pipeline and whatever the later stages take longer than the driver's own. On a CPU the ranks
share the same cores, so neither can speed anything up here; this records the price of the
communication, and the decode throughput beside it.
SmolLM2 has 9 attention heads and 3 KV heads, so its valid TP sizes are 1, 3 and 9; `--model`
takes another checkpoint of its vocabulary (say, a random one with 8 heads, for TP 2). The
prompts are SmolLM2's chat template and tokens whatever the model.
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
from engine.distributed import PPGroup, TPGroup
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.model_store import DEFAULT_MODEL, pull
from engine.sampling_params import SamplingParams

# Where rank 0 waits on other ranks; the sends are asynchronous, so they never hold it up.
TIMED = ((TPGroup, "all_reduce"), (TPGroup, "all_gather_last_dim"), (PPGroup, "recv_logits"))


class CommunicationClock:
    """Wraps the communication methods in this process to add up the time spent in them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.originals = [getattr(cls, name) for cls, name in TIMED]

    def __enter__(self) -> CommunicationClock:
        for (cls, name), method in zip(TIMED, self.originals, strict=True):
            setattr(cls, name, self._timed(method))
        return self

    def __exit__(self, *exc: object) -> None:
        for (cls, name), method in zip(TIMED, self.originals, strict=True):
            setattr(cls, name, method)

    def _timed(self, method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def timed(group: TPGroup | PPGroup, *args: Any) -> torch.Tensor:
            if group.size == 1:
                return method(group, *args)
            started = time.perf_counter()
            try:
                return method(group, *args)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        return timed


def measure(
    model: str, tp_size: int, pp_size: int, num_requests: int, max_tokens: int, dtype: str
) -> dict[str, Any]:
    gguf = pull(DEFAULT_MODEL)
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            tensor_parallel_size=tp_size,
            pipeline_parallel_size=pp_size,
            cpu_kv_cache_gib=0.5,
        )
    )
    workload = make_workload(
        num_requests,
        0,
        load_checkpoint(gguf).tokenizer,
        prompt_tokens=(64, 256),
        output_tokens=(max_tokens, max_tokens),
    )
    try:
        with CommunicationClock() as clock:
            for i, request in enumerate(workload):
                engine.add_request(
                    str(i),
                    list(request.prompt_token_ids),
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                )
            started = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            seconds = time.perf_counter() - started
    finally:
        engine.shutdown()
    num_tokens = num_requests * max_tokens
    return {
        "tp": tp_size,
        "pp": pp_size,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(num_tokens / seconds, 1),
        "communication_s": round(clock.seconds, 2),
        "communication_calls": clock.calls,
        "communication_share": round(clock.seconds / seconds, 3),
    }


def layout(text: str) -> tuple[int, int]:
    tp, _, pp = text.partition("x")
    if not (tp.isdigit() and pp.isdigit()) or int(tp) < 1 or int(pp) < 1:
        raise argparse.ArgumentTypeError(f"a layout is TPxPP, e.g. 3x1 or 1x2, not {text!r}")
    return int(tp), int(pp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", type=layout, nargs="+", default=[(1, 1), (3, 1), (1, 2)])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for tp, pp in args.layouts:
        print(f"TP {tp} x PP {pp}...", file=sys.stderr, flush=True)
        rows.append(measure(args.model, tp, pp, args.num_requests, args.max_tokens, args.dtype))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = f"{'TP':>3} {'PP':>3} {'seconds':>8} {'tokens/s':>9} {'communicating s':>16}"
    print(f"{header} {'share':>6}")
    for r in rows:
        print(
            f"{r['tp']:>3} {r['pp']:>3} {r['seconds']:>8} {r['output_tokens_per_s']:>9} "
            f"{r['communication_s']:>16} {r['communication_share']:>6.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
