"""TTFT of a burst of prompts into an idle engine, by the budget of steps without decodes
(`max_num_prefill_only_tokens`), A/B in one process: rounds alternate between the budgets on
one engine, so the load of a shared machine falls on each about evenly.

    python -m bench.prefill_burst [--num-prompts 16] [--prompt-tokens 128 512]
        [--max-tokens 16] [--budgets none 1024 2048] [--rounds 3]

Each round submits NUM_PROMPTS prompts at once (seeded lengths drawn from PROMPT_TOKENS, greedy,
`ignore_eos`, MAX_TOKENS each; prefix caching off, so no round reuses another's blocks) and
steps until all are done. `none` is the step budget alone (`max_num_batched_tokens`). Prints
per budget the TTFT p50/mean/max, the p50/max inter-token latency after the first token (what
the budget must not blow up), and the time to drain the burst; the load average and CPU flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from bench.loadgen import percentile
from bench.report import load_average, machine, report_out
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_store import DEFAULT_MODEL, pull
from engine.sampling_params import SamplingParams


def add_burst_arguments(parser: argparse.ArgumentParser, prompt_tokens: list[int]) -> None:
    """The flags of a benchmark of bursts: how many prompts, their lengths (`prompt_tokens` by
    default), how many rounds, where the JSON report goes."""
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=prompt_tokens)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)


def seeded_prompts(count: int, lengths: list[int]) -> list[list[int]]:
    """`count` prompts of random tokens, their lengths drawn from `lengths` (low, high)."""
    rng = random.Random(0)
    return [
        [100 + rng.randrange(40_000) for _ in range(rng.randint(*lengths))] for _ in range(count)
    ]


def run_burst(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"burst-{i}-{started}", prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itls: list[float] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in first:
                first[out.request_id] = now - started
            else:
                itls.append(now - last[out.request_id])
            last[out.request_id] = now
    ttfts = list(first.values())
    return {
        "ttft_p50_s": percentile(ttfts, 50) or 0.0,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_max_s": max(ttfts),
        "itl_p50_s": percentile(itls, 50) or 0.0,
        "itl_max_s": max(itls, default=0.0),
        "drain_s": time.perf_counter() - started,
    }


def ab_bursts(
    engine: LLMEngine,
    prompts: Callable[[], list[list[int]]],
    before: AbstractContextManager[object],
    rounds: int,
    max_tokens: int,
) -> list[dict[str, dict[str, float]]]:
    """Rounds of bursts (each from `prompts()`), alternating which goes first: `before` inside
    the context, `after` outside it."""
    run_burst(engine, prompts(), 2)  # warm up both paths' shapes
    with before:
        run_burst(engine, prompts(), 2)
    results = []
    for r in range(rounds):
        one: dict[str, dict[str, float]] = {}
        for name in ["before", "after"] if r % 2 == 0 else ["after", "before"]:
            with before if name == "before" else nullcontext():
                one[name] = run_burst(engine, prompts(), max_tokens)
        results.append(one)
        b, a = one["before"], one["after"]
        print(
            f"  round {r + 1}: TTFT p50 / max before {b['ttft_p50_s']:.3f} / "
            f"{b['ttft_max_s']:.3f} s, after {a['ttft_p50_s']:.3f} / {a['ttft_max_s']:.3f} s"
            f" ({b['ttft_max_s'] / a['ttft_max_s']:.2f}x); drain {b['drain_s']:.2f} /"
            f" {a['drain_s']:.2f} s ({b['drain_s'] / a['drain_s']:.2f}x)",
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_burst_arguments(parser, [128, 512])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--budgets", nargs="+", default=["none", "1024", "2048"])
    args = parser.parse_args(argv)
    config = EngineConfig(str(pull(DEFAULT_MODEL)), enable_prefix_caching=False)
    engine = LLMEngine(config)
    prompts = seeded_prompts(args.num_prompts, args.prompt_tokens)
    run_burst(engine, prompts[:2], 2)  # warm up
    base = engine.scheduler.config
    load_before = load_average()
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = args.budgets if r % 2 == 0 else list(reversed(args.budgets))
        results = {}
        for name in order:
            budget = None if name == "none" else int(name)
            engine.scheduler.config = dataclasses.replace(base, max_num_prefill_only_tokens=budget)
            results[name] = run_burst(engine, prompts, args.max_tokens)
        rounds.append(results)
        print(
            "  ".join(
                f"{n}: TTFT p50 {x['ttft_p50_s']:.2f} mean {x['ttft_mean_s']:.2f} "
                f"max {x['ttft_max_s']:.2f} s, ITL p50 {x['itl_p50_s'] * 1e3:.0f} "
                f"max {x['itl_max_s'] * 1e3:.0f} ms, drain {x['drain_s']:.2f} s"
                for n, x in ((n, results[n]) for n in args.budgets)
            ),
            flush=True,
        )
    report = {
        "num_prompts": args.num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "num_prompt_tokens": sum(len(p) for p in prompts),
        "rounds": rounds,
        **machine(load_before),
    }
    report_out(report, args.json, ("num_prompt_tokens", "load_average"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
