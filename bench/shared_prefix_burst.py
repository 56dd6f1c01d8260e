"""A burst of prompts that share a cold prefix (one system prompt, not yet cached) into an idle
engine, A/B in one process: `before` lets every request compute the shared blocks in the same
step, `after` is the scheduler's rule (a request reads the blocks another fills in that step).

    python -m bench.shared_prefix_burst [--num-prompts 16] [--shared-tokens 32]
        [--own-tokens 16 48] [--rounds 4] [--dtype auto]

Each round's burst starts with its own shared prefix (seeded tokens), so that it is cold in
both variants; each prompt then has its own seeded tail of OWN_TOKENS, greedy, 4 tokens out.
Rounds alternate which variant goes first, on one engine (`prefill_burst.ab_bursts`). Prints
TTFT p50/max and drain time per round with before / after ratios; the load average and CPU
flags beside them.
"""

from __future__ import annotations

import argparse
import random
from unittest import mock

from bench.prefill_burst import ab_bursts
from bench.report import load_average, machine, report_out
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_store import DEFAULT_MODEL, pull
from engine.scheduler import Scheduler


def burst(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    shared = [100 + rng.randrange(40_000) for _ in range(args.shared_tokens)]
    return [
        shared + [100 + rng.randrange(40_000) for _ in range(rng.randint(*args.own_tokens))]
        for _ in range(args.num_prompts)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--shared-tokens", type=int, default=32)
    parser.add_argument("--own-tokens", type=int, nargs=2, default=[16, 48])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(str(pull(DEFAULT_MODEL)), dtype=args.dtype))
    rng = random.Random(0)
    every_request_computes = mock.patch.object(
        Scheduler, "_blocks_filled_by", lambda self, batch, start=0: dict[bytes, int]()
    )
    load_before = load_average()
    rounds = ab_bursts(engine, lambda: burst(rng, args), every_request_computes, args.rounds, 4)
    report = {
        "args": vars(args),
        "rounds": rounds,
        **machine(load_before),
    }
    report_out(report, args.json, ("load_average", "cpu_flags"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
