"""How far an fp8 KV cache moves the real model's outputs from the model-dtype cache.

    python -m bench.kv_cache_accuracy [--dtype auto] [--max-tokens 64] [--json PATH]

Loads SmolLM2 twice, `kv_cache_dtype="auto"` and `"fp8"`, and runs the same prompts greedily on
both: chat questions, and the benchmark workload's longer synthetic prompts (up to 512 tokens, so
that decodes read many quantized keys). Reports the share of generated tokens equal at the same
position (a reply that diverges counts every later position as different, its tokens being
conditioned on other text), the replies equal throughout, the same share for the auto cache run
one prompt at a time (other batch shapes, so other roundings: the floor of what the model's
dtype repeats), and the first step's logits (the prompt's last position, prefilled in one
chunk) as the largest absolute difference, beside the logits' own spread.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.report import load_average, machine, report_out
from bench.workload import make_workload
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_store import DEFAULT_MODEL, pull
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

QUESTIONS = [
    "What is the capital of France?",
    "Explain in one sentence why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
    "How do I boil an egg?",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Give me a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Why do cats purr?",
    "Describe a sunset over the ocean.",
]
NUM_WORKLOAD_PROMPTS = 8


def prompt_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """The logits at every position of one prompt, prefilled in one chunk through the pool."""
    kv = engine.scheduler.kv_cache
    seq = Sequence("probe", token_ids, SamplingParams(), max_tokens=1)
    assert kv.allocate_slots(seq, len(token_ids))
    runner = engine.executor.runner
    try:
        inputs, _ = runner.prepare(ScheduledBatch([seq], [len(token_ids)]))
        inputs.logits_rows = torch.arange(len(token_ids))
        return runner.run(inputs)
    finally:
        kv.free(seq)


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    replies: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                replies[output.request_id] = list(output.outputs[0].token_ids)
    return [replies[str(i)] for i in range(len(prompts))]


def agreement(reference: list[list[int]], replies: list[list[int]]) -> tuple[float, list[int]]:
    """The share of `reference`'s tokens that `replies` repeat at the same position before
    they first differ, and the first differing position of each reply that differs."""
    same = total = 0
    first_diffs = []
    for ref, ours in zip(reference, replies, strict=True):
        total += len(ref)
        pairs = zip(ref, ours, strict=False)
        n = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ref), len(ours)))
        same += n
        if n < len(ref) or len(ours) != len(ref):
            first_diffs.append(n)
    return same / total, first_diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", help="the engine's dtype")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    load_before = load_average()
    gguf = pull(DEFAULT_MODEL)
    runs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        started = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(str(gguf), dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
                         cpu_kv_cache_gib=0.25)
        )  # fmt: skip
        tokenizer = engine.tokenizer
        prompts = [tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": q}]))
                   for q in QUESTIONS]  # fmt: skip
        prompts += [list(r.prompt_token_ids)
                    for r in make_workload(NUM_WORKLOAD_PROMPTS, 0, tokenizer)]  # fmt: skip
        logits = torch.stack([prompt_logits(engine, ids)[-1] for ids in prompts])
        runs[kv_cache_dtype] = (logits, greedy(engine, prompts, args.max_tokens))
        if kv_cache_dtype == "auto":  # the same cache, other batch shapes: the floor
            one_at_a_time = [greedy(engine, [ids], args.max_tokens)[0] for ids in prompts]
        engine.shutdown()
        print(f"{kv_cache_dtype}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    (ref_logits, ref_replies), (fp8_logits, fp8_replies) = runs["auto"], runs["fp8"]
    same, first_diffs = agreement(ref_replies, fp8_replies)
    floor, _ = agreement(ref_replies, one_at_a_time)
    diff = (fp8_logits - ref_logits).abs()
    report = {
        "command": "python -m bench.kv_cache_accuracy " + " ".join(argv or sys.argv[1:]),
        "prompts": len(ref_replies),
        "greedy_tokens_identical": round(same, 4),
        "greedy_tokens_identical_auto_one_at_a_time": round(floor, 4),
        "replies_identical": f"{len(ref_replies) - len(first_diffs)}/{len(ref_replies)}",
        "first_divergence_positions": first_diffs,
        "first_step_logits_max_abs_diff": round(float(diff.max()), 4),
        "first_step_logits_mean_abs_diff": round(float(diff.mean()), 5),
        "first_step_logits_range": round(float(ref_logits.max() - ref_logits.min()), 2),
        "first_step_top1_equal": f"{int((fp8_logits.argmax(-1) == ref_logits.argmax(-1)).sum())}"
        f"/{len(ref_replies)}",
        **machine(load_before),
    }
    report_out(report, args.json, list(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
