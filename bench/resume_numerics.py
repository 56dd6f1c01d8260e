"""Where a resumed greedy generation parts from the unbroken one, and why (issue 15).

    python -m bench.resume_numerics [--dtype bfloat16] [--num-tokens 40] [--resume-at 12]

One in-process engine (prefix caching off, so that a continuation prefills everything), four
greedy chat prompts of `--num-tokens` tokens (`ignore_eos`), and for each the output position
where two runs first differ (None: identical):

1. alone against in one batch of four: the same prompt, only what shares its steps differs;
2. a resume after `--resume-at` tokens against the unbroken run, both alone: the continuation
   prefills prompt and resumed tokens as one chunk, the unbroken run made them by decode steps;
3. the same, four resumed together against the four decoded together.

Read: if 1 differs, a token's logits depend on the batch it is computed in (the matmuls' row
count), and no resume can promise the unbroken text; if 2 or 3 differ, prefilling the resumed
tokens computes their KV differently from the decode steps that made them.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from bench.report import cpu_vector_flags, load_average
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_store import DEFAULT_MODEL
from engine.sampling_params import SamplingParams

TOPICS = ["robots", "the sea", "a city", "winter"]

# (prompt ids, resumed output ids or None, max new tokens)
Job = tuple[list[int], list[int] | None, int]


class Runs:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def outputs(self, jobs: list[Job]) -> list[list[int]]:
        """All jobs at once; each one's output ids (the resumed ones included: cumulative)."""
        request_ids = []
        for prompt, resumed, max_tokens in jobs:
            request_id = f"r{next(self._ids)}"
            request_ids.append(request_id)
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            self.engine.add_request(request_id, prompt, params, resumed_token_ids=resumed)
        done: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = list(output.outputs[0].token_ids)
        return [done[request_id] for request_id in request_ids]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.resume_numerics", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-tokens", type=int, default=40)
    parser.add_argument("--resume-at", type=int, default=12)
    args = parser.parse_args(argv)
    n, k = args.num_tokens, args.resume_at
    config = EngineConfig(
        model=DEFAULT_MODEL,
        dtype=args.dtype,
        num_kv_blocks=512,
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    runs = Runs(engine)
    tokenizer = engine.tokenizer
    prompts = [
        tokenizer.encode(
            tokenizer.render_chat(
                [{"role": "user", "content": f"Write a long essay about {topic}."}]
            )
        )
        for topic in TOPICS
    ]
    load_before = load_average()
    alone = [runs.outputs([(p, None, n)])[0] for p in prompts]
    batched = runs.outputs([(p, None, n) for p in prompts])
    resumed_alone = [
        runs.outputs([(p, a[:k], n - k)])[0] for p, a in zip(prompts, alone, strict=True)
    ]
    resumed_batched = runs.outputs(
        [(p, b[:k], n - k) for p, b in zip(prompts, batched, strict=True)]
    )
    print(f"{args.dtype}, {n} greedy tokens, resumed after {k} (first differing position):")
    print(
        f"  alone vs in a batch of {len(prompts)}:",
        [first_difference(a, b) for a, b in zip(alone, batched, strict=True)],
    )
    print(
        "  resumed vs unbroken, alone:",
        [first_difference(a, r) for a, r in zip(alone, resumed_alone, strict=True)],
    )
    print(
        f"  resumed vs unbroken, {len(prompts)} together:",
        [first_difference(b, r) for b, r in zip(batched, resumed_batched, strict=True)],
    )
    print(
        f"load average {load_before} -> {load_average()}; CPU flags: "
        f"{' '.join(cpu_vector_flags()) or 'no AVX-512'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
