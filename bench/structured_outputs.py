"""Structured outputs' cost in a batch: 32 requests where half are JSON-schema constrained,
against the same 32 all free, on the real model, in one run; and a new schema's compile time.

    python -m bench.structured_outputs [--num-requests 32] [--max-tokens 128] [--rounds 3]
        [--json PATH]

Every request gets the same chat prompt and runs `max_tokens` tokens: the free ones with
`ignore_eos`, the constrained ones under a schema whose shortest document is longer than that
(an array of at least 1,000 strings), so both batches decode the same number of tokens. Greedy.
ITL: the time between a request's consecutive tokens (median and p99 over all requests);
throughput: output tokens over the run's wall time. Compile time: a new schema through the
engine's compiler (the vocabulary set-up, paid once, apart), then the mask and matcher costs
seen per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.loadgen import percentile
from bench.report import load_average, machine, report_out
from engine.config import EngineConfig
from engine.grammar import CompiledGrammar, GrammarCompiler
from engine.grammar_spec import GrammarSpec
from engine.llm_engine import LLMEngine
from engine.model_store import DEFAULT_MODEL, pull
from engine.sampler import SamplingRequest, process_logits
from engine.sampling_params import RequestOutputKind, SamplingParams

PROMPT = [{"role": "user", "content": "List as many fruits as you can, as JSON."}]
FRUITS = {"fruits": {"type": "array", "items": {"type": "string"}, "minItems": 1000}}
LONG_SCHEMA = {
    "type": "object",
    "properties": FRUITS,
    "required": ["fruits"],
    "additionalProperties": False,
}


def _run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, float]:
    prompt = engine.tokenizer.render_chat(PROMPT, add_generation_prompt=True)
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(params))]
    last: dict[str, float] = {}
    itls: list[float] = []
    num_tokens = 0
    started = time.perf_counter()
    for request_id, p in zip(ids, params, strict=True):
        engine.add_request(request_id, prompt, p)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            new = len(output.outputs[0].token_ids)
            num_tokens += new
            if output.request_id in last and new:
                itls.append(now - last[output.request_id])
            last[output.request_id] = now
    wall_s = time.perf_counter() - started
    return {
        "tokens_per_s": round(num_tokens / wall_s, 1),
        "itl_median_ms": round(1e3 * statistics.median(itls), 2),
        "itl_p99_ms": round(1e3 * (percentile(itls, 99) or 0.0), 2),
        "num_output_tokens": num_tokens,
        "wall_s": round(wall_s, 2),
    }


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def _compile_times(engine: LLMEngine) -> dict[str, object]:
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size)
    started = time.perf_counter()
    compiler.compile(GrammarSpec("json_object")).result()
    first_ms = 1e3 * (time.perf_counter() - started)
    times = []
    for i in range(5):
        schema = {**LONG_SCHEMA, "properties": {**FRUITS, f"field{i}": {"type": "integer"}}}
        started = time.perf_counter()
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema))).result()
        times.append(1e3 * (time.perf_counter() - started))
    compiled = compiler.compile(GrammarSpec("json_schema", json.dumps(LONG_SCHEMA))).result()
    compiler.shutdown()
    return {
        "first_compile_with_vocabulary_ms": round(first_ms, 1),
        "new_schema_compile_median_ms": round(statistics.median(times), 2),
        "logits_processing_ms": _processing_times(engine, compiled),
    }


def _processing_times(engine: LLMEngine, compiled: CompiledGrammar) -> dict[str, float]:
    """`process_logits` on a batch of 32 rows: none constrained, and half (masks filled and
    applied), each the median of 50 calls."""
    vocab_size = engine.model_config.vocab_size
    logits = torch.randn(32, vocab_size)
    free = SamplingRequest(SamplingParams(temperature=0), 0)
    result = {}
    for name, num_constrained in (("none_constrained", 0), ("half_constrained", 16)):
        requests = [
            SamplingRequest(free.params, 0, None, GrammarCompiler.matcher(compiled, []))
            if i < num_constrained
            else free
            for i in range(32)
        ]
        times = []
        for _ in range(50):
            started = time.perf_counter()
            process_logits(logits.clone(), requests, frozenset())
            times.append(1e3 * (time.perf_counter() - started))
        result[name] = round(statistics.median(times), 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    load_before = load_average()
    model = str(pull(DEFAULT_MODEL, progress=lambda done, total: None, say=lambda m: None))
    engine = LLMEngine(EngineConfig(model=model, max_model_len=1024, cpu_kv_cache_gib=0.5))
    free = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    constrained = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        output_kind=RequestOutputKind.DELTA,
        grammar=GrammarSpec("json_schema", json.dumps(LONG_SCHEMA)),
    )
    n = args.num_requests
    _run(engine, [free] * 4)  # warm-up: kernels, the thread policy, the grammar cache
    _run(engine, [constrained] * 2)
    # Alternating rounds, each side's median run reported: the machine's load varies.
    free_runs, half_runs = [], []
    for _ in range(args.rounds):
        free_runs.append(_run(engine, [free] * n))
        half_runs.append(_run(engine, [constrained if i % 2 else free for i in range(n)]))
    all_free = _median_run(free_runs)
    half = _median_run(half_runs)
    report = {
        "num_requests": n,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "all_free": all_free,
        "half_constrained": half,
        "runs": {"all_free": free_runs, "half_constrained": half_runs},
        "throughput_ratio": round(half["tokens_per_s"] / all_free["tokens_per_s"], 3),
        **_compile_times(engine),
        "machine": machine(load_before),
    }
    engine.shutdown()
    report_out(
        report,
        args.json,
        [
            "all_free",
            "half_constrained",
            "throughput_ratio",
            "new_schema_compile_median_ms",
            "logits_processing_ms",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
