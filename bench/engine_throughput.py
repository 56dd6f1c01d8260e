"""Engine throughput on the real model against Hugging Face transformers, in one run.

    python -m bench.engine_throughput [--workload mixed|prompt-heavy] [--num-requests N]
        [--concurrency 32] [--baseline-requests N] [--json PATH]

Replays a seeded workload with transformers sequentially (batch 1) and in static padded batches
of 8 (fp32: its best setting here), then with our engine at the given concurrency. `mixed`: 64
chat requests, prompts of 32-512 tokens, outputs of 16-256. `prompt-heavy`: 32 requests, each
prompt 3x its output (outputs 16-256), all submitted at once, so the batch drains to a few long
requests. `--concurrency 1` measures a single stream against transformers' sequential run only
(the decode ITL ratio is the figure there). Outputs are `ignore_eos`, greedy. Each request's
TTFT counts from when the driver submits it, under each system's own concurrency. Also samples
the KV-cache use each step; measures TTFT on 16 held-out shared prefixes (seeded tokens, 350 and a
12-token question; with caching on, each prefix is cached by another question first, so only its
last partial block and the question are computed), with and without prefix caching, interleaved;
and at concurrency > 1 prints the processed (prompt + output) tokens per second against the bf16
matmul ceiling of the model's shapes (bench/matmul_ceiling.py). The report carries the CPU's
vector flags and the load average, which every figure depends on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.decode_floor import decode_floor, read_bandwidth
from bench.loadgen import percentile
from bench.matmul_ceiling import matmul_ceiling
from bench.report import cpu_vector_flags, load_average
from bench.workload import WorkloadRequest, make_workload
from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.model_store import DEFAULT_MODEL, pull
from engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import GenerationMixin


@dataclass(slots=True)
class RunResult:
    name: str
    duration_s: float
    num_output_tokens: int
    ttfts_s: list[float] = field(default_factory=list, repr=False)
    itls_s: list[float] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.duration_s

    def summary(self) -> dict[str, float | str | None]:
        return {
            "name": self.name,
            "duration_s": round(self.duration_s, 2),
            "output_tokens": self.num_output_tokens,
            "output_tokens_per_s": round(self.tokens_per_s, 1),
            "ttft_p50_s": _round(percentile(self.ttfts_s, 50)),
            "ttft_p99_s": _round(percentile(self.ttfts_s, 99)),
            "itl_p50_s": _round(percentile(self.itls_s, 50)),
            "itl_p99_s": _round(percentile(self.itls_s, 99)),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def progress(label: str, done: int, total: int) -> None:
    print(
        f"\r{label}: {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True
    )


class _TokenClock:
    """A transformers streamer that notes when each generated step arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(
    model: GenerationMixin, workload: list[WorkloadRequest], batch_size: int
) -> RunResult:
    name = (
        "transformers sequential" if batch_size == 1 else f"transformers static batch {batch_size}"
    )
    result = RunResult(name, 0.0, 0)
    started = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first : first + batch_size]
        longest_prompt = max(r.num_prompt_tokens for r in batch)
        ids = torch.full((len(batch), longest_prompt), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(batch):  # left padding, as decoder-only batching needs
            ids[row, longest_prompt - request.num_prompt_tokens :] = torch.tensor(
                request.prompt_token_ids
            )
            mask[row, longest_prompt - request.num_prompt_tokens :] = 1
        max_new = max(r.max_tokens for r in batch)
        clock = _TokenClock()
        submitted = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=2,
                streamer=clock,
            )
        # Only each request's own max_tokens are useful; the rest pads the static batch.
        for request in batch:
            times = clock.times[: request.max_tokens]
            result.ttfts_s.append(times[0] - submitted)
            result.itls_s += [b - a for a, b in itertools.pairwise(times)]
            result.num_output_tokens += request.max_tokens
        progress(name, first + len(batch), len(workload))
    result.duration_s = time.perf_counter() - started
    return result


@dataclass(slots=True)
class KvUse:
    """Live tokens over reserved token slots, sampled after every step, for the paged cache and
    for what a server that reserves each request's KV contiguously when it admits it would hold
    for the same running requests (no run of its own: the same steps, counted twice)."""

    paged: list[float] = field(default_factory=list)
    # Reserving the context length: a server that preallocates must, since a request may run to
    # it (OpenAI's max_tokens is optional); the vLLM paper's "Orca (Max)".
    max_context: list[float] = field(default_factory=list)
    # Reserving prompt + max_tokens: the best a preallocating server can do when every request
    # states its output cap (this workload's do); "Orca (Oracle)" up to ignore_eos.
    prompt_and_max_tokens: list[float] = field(default_factory=list)
    contexts: list[int] = field(default_factory=list)  # each running request's, each step

    def sample(self, engine: LLMEngine) -> None:
        """Tokens whose K/V live requests hold, over the slots of the blocks they hold (a block
        shared by two requests counts for each): what paging wastes is the tails of blocks."""
        running = engine.scheduler.running
        held = sum(seq.num_computed_tokens for seq in running)
        if not held:
            return
        allocated = sum(len(seq.block_table) for seq in running) * engine.config.block_size
        context = engine.max_model_len
        stated = sum(min(context, seq.num_prompt_tokens + seq.max_tokens) for seq in running)
        self.contexts += [seq.num_computed_tokens for seq in running]
        self.paged.append(held / allocated)
        self.max_context.append(held / (context * len(running)))
        self.prompt_and_max_tokens.append(held / stated)

    def summary(self, context_len: int) -> dict[str, float]:
        return {
            "paged_mean": round(statistics.fmean(self.paged), 4),
            "paged_min": round(min(self.paged), 4),
            "contiguous_max_context_mean": round(statistics.fmean(self.max_context), 4),
            "contiguous_prompt_and_max_tokens_mean": round(
                statistics.fmean(self.prompt_and_max_tokens), 4
            ),
            "context_len": context_len,
        }


def run_engine(
    engine: LLMEngine,
    workload: list[WorkloadRequest],
    concurrency: int,
    name: str,
    on_step: Callable[[LLMEngine], None] | None = None,
) -> RunResult:
    """Keep `concurrency` requests in flight; note when each request's tokens arrive."""
    result = RunResult(name, 0.0, 0)
    submitted: dict[str, float] = {}
    last_token: dict[str, float] = {}
    pending = list(enumerate(workload))[::-1]
    done = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(submitted) < concurrency:
            index, request = pending.pop()
            params = SamplingParams(
                temperature=0.0,
                max_tokens=request.max_tokens,
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,
            )
            request_id = f"{name}-{index}"
            engine.add_request(request_id, list(request.prompt_token_ids), params)
            submitted[request_id] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if on_step is not None:
            on_step(engine)
        for output in outputs:
            rid = output.request_id
            num_new = len(output.outputs[0].token_ids)
            result.num_output_tokens += num_new
            if rid not in last_token:
                result.ttfts_s.append(now - submitted[rid])
            else:
                result.itls_s.append(now - last_token[rid])
            last_token[rid] = now
            if output.finished:
                del submitted[rid]
                done += 1
                progress(name, done, len(workload))
    result.duration_s = time.perf_counter() - started
    return result


SHARED_PREFIX_TOKENS = 350  # not a multiple of a block: the last partial block is computed
QUESTION_TOKENS = 12


def shared_prefixes(seed: int, vocab_size: int, num_requests: int) -> list[list[int]]:
    """`num_requests` prompts, each a held-out prefix (seeded tokens no tuning has seen) and a
    question of its own."""
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(SHARED_PREFIX_TOKENS + QUESTION_TOKENS)]
        for _ in range(num_requests)
    ]


def shared_prefix_ttfts(engine: LLMEngine, prompts: list[list[int]], name: str) -> list[float]:
    """TTFT of each prompt, one after another. With prefix caching on, another question on the
    same prefix runs first (untimed), so the timed request finds all the prefix's full blocks
    cached and computes only its last partial block and its question."""
    warm = engine.scheduler.kv_cache.enable_prefix_caching
    ttfts = []
    for i, prompt in enumerate(prompts):
        if warm:
            other_question = prompt[:SHARED_PREFIX_TOKENS] + prompt[-1:] * QUESTION_TOKENS
            _first_token_s(engine, f"{name}-warm-{i}", other_question)
        ttfts.append(_first_token_s(engine, f"{name}-{i}", prompt))
        progress(name, i + 1, len(prompts))
    return ttfts


def _first_token_s(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=4))
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter() - started
    assert first is not None
    return first


SHARED_PREFIX_KV_BLOCKS = 64  # the shared-prefix requests' ~400 tokens, one at a time

# (number of requests, prompt tokens per output token); None: prompts of 32-512 drawn apart.
WORKLOADS: dict[str, tuple[int, int | None]] = {"mixed": (64, None), "prompt-heavy": (32, 3)}


def kv_cache_dtypes(text: str) -> list[str]:
    names = text.split(",")
    if not names or any(name not in KV_CACHE_DTYPES for name in names):
        raise argparse.ArgumentTypeError(f"each must be one of {', '.join(KV_CACHE_DTYPES)}")
    return names


def report_kv_cache(engine: LLMEngine, tensor_parallel_size: int) -> float:
    """Print the pool's size; return it in GiB over all ranks (each TP rank holds its share of
    the KV heads of its stage's layers)."""
    kv = engine.scheduler.kv_cache
    runner = engine.executor.runner
    per_block = runner.kv_bytes_per_block_per_layer * engine.model_config.num_layers
    gib = kv.num_blocks * per_block * tensor_parallel_size / 2**30
    per_token = per_block * tensor_parallel_size // kv.block_size
    print(
        f"KV cache ({runner.kv_dtype}): {kv.num_blocks} blocks of {kv.block_size} tokens "
        f"({kv.num_blocks * kv.block_size} tokens, {gib:.2f} GiB; {per_token} bytes a token, "
        "what a decode step's attention reads per token of context)",
        file=sys.stderr,
    )
    return round(gib, 2)


def prefix_cache_ttfts(
    engine: LLMEngine, config: EngineConfig, seed: int
) -> tuple[list[float], list[float]]:
    """Shared-prefix TTFTs on `engine` (caching on) and on an engine like it without caching,
    the two interleaved request by request (a shared machine's load moves)."""
    prompts = shared_prefixes(seed, engine.model_config.vocab_size, 16)
    uncached_engine = LLMEngine(
        EngineConfig(
            model=config.model,
            dtype=config.dtype,
            quantization=config.quantization,
            enable_prefix_caching=False,
            # One request at a time needs a few blocks; a pool of the default size would not
            # fit beside the first engine's on a GPU, where each takes its share of the device.
            num_kv_blocks=SHARED_PREFIX_KV_BLOCKS,
        )
    )
    cached, uncached = [], []
    for i, prompt in enumerate(prompts):
        cached += shared_prefix_ttfts(engine, [prompt], f"shared prefix {i}, cache on")
        uncached += shared_prefix_ttfts(uncached_engine, [prompt], f"shared prefix {i}, cache off")
    uncached_engine.shutdown()
    return cached, uncached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="default: 64 mixed, 32 prompt-heavy"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="our engine's dtype")
    parser.add_argument(
        "--quantization",
        choices=("auto", "none", "int8", "q4_1"),
        default="auto",
        help="our engine's weights (int8: weight-only; q4_1: a Q4_1 GGUF's blocks kept; CPU)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        type=kv_cache_dtypes,
        default=["auto"],
        help="our engine's KV cache: auto, fp8, or several comma-separated (auto,fp8), each "
        "run in turn on the same workload",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--baseline-requests",
        type=int,
        default=None,
        help="run transformers on only the first N requests (at ~11 tok/s it needs over 30 "
        "minutes for all 64 on 2 cores); ours always runs the whole workload",
    )
    parser.add_argument(
        "--skip-transformers", action="store_true", help="ours only (no ratios): for profiling"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    load_before = load_average()
    # Every core's read rate, before transformers or our engine change torch's thread count.
    bandwidth = read_bandwidth() if args.concurrency == 1 else 0.0
    all_threads = torch.get_num_threads()  # what big steps run on (engine/step_threads.py)
    gguf = pull(DEFAULT_MODEL)
    default_requests, prompt_per_output = WORKLOADS[args.workload]
    workload = make_workload(
        default_requests if args.num_requests is None else args.num_requests,
        args.seed,
        load_checkpoint(gguf).tokenizer,
        prompt_per_output=prompt_per_output,
    )
    num_prompt = sum(r.num_prompt_tokens for r in workload)
    num_output = sum(r.max_tokens for r in workload)
    print(
        f"workload {args.workload}: {len(workload)} requests, "
        f"{num_prompt} prompt tokens, {num_output} output tokens",
        file=sys.stderr,
    )
    runs: list[RunResult] = []
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        baseline = workload[: args.baseline_requests]
        # A single stream is compared with a single stream; batches of 8 only with batches.
        for batch_size in (1,) if args.concurrency == 1 else (1, 8):
            runs.append(run_transformers(reference, baseline, batch_size))
        del reference

    config = EngineConfig(
        model=str(gguf),
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.concurrency,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
    )
    baselines = list(runs)
    kv_use: dict[str, dict[str, float]] = {}
    kv_gib: dict[str, float] = {}
    floors: dict[str, dict[str, float]] = {}
    for index, kv_cache_dtype in enumerate(args.kv_cache_dtype):
        engine = LLMEngine(replace(config, kv_cache_dtype=kv_cache_dtype))
        kv_gib[kv_cache_dtype] = report_kv_cache(engine, args.tensor_parallel_size)
        if index == 0 and args.concurrency > 1:
            output_share = num_output / (num_prompt + num_output)
            ceiling = matmul_ceiling(engine.model_config, output_share, all_threads)
        use = KvUse()
        runner = engine.executor.runner
        runs.append(
            run_engine(
                engine,
                workload,
                args.concurrency,
                f"meridian c={args.concurrency} ({runner.dtype}, "
                f"{args.quantization}: {runner.quantization} weights, KV {runner.kv_dtype})",
                use.sample,
            )
        )
        kv_use[kv_cache_dtype] = use.summary(engine.max_model_len)
        if args.concurrency == 1:  # what one stream's step cannot go below
            mean_context = statistics.fmean(use.contexts)
            floors[kv_cache_dtype] = decode_floor(engine, mean_context, bandwidth).summary()
        if index == 0:  # the prefix cache's figures, once
            cached, uncached = prefix_cache_ttfts(engine, config, args.seed)
        engine.shutdown()
    ours = runs[len(baselines)]

    report: dict = {
        "command": "python -m bench.engine_throughput " + " ".join(argv or sys.argv[1:]),
        "workload": args.workload,
        "cpu_flags": cpu_vector_flags(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "torch_threads": torch.get_num_threads(),
        "kv_cache_gib": kv_gib,
        "runs": [r.summary() for r in runs],
        "kv_cache_use": kv_use,
        "decode_floor": floors,
        "prefix_cache_ttft_p50_s": {
            "on": round(statistics.median(cached), 4),
            "off": round(statistics.median(uncached), 4),
        },
    }
    if not args.skip_transformers:
        report["ratios"] = {
            f"vs {r.name}": round(ours.tokens_per_s / r.tokens_per_s, 2) for r in baselines
        }
        sequential_itl, our_itl = percentile(runs[0].itls_s, 50), percentile(ours.itls_s, 50)
        if sequential_itl and our_itl:
            # How much faster one decode step is: the single-stream figure at concurrency 1.
            report["itl_p50_ratio_vs_transformers_sequential"] = round(sequential_itl / our_itl, 2)
    if args.concurrency > 1:
        processed = (num_prompt + num_output) / ours.duration_s
        report["matmul_ceiling"] = {
            "processed_tokens_per_s": round(processed, 1),
            "ceiling_tokens_per_s": round(ceiling.tokens_per_s, 1),
            "bf16_gflop_per_s": round(ceiling.gflop_per_s, 1),
            "gflop_per_token": round(ceiling.gflop_per_token, 4),
            "share": round(ceiling.share(processed), 3),
        }
    report["prefix_cache_ttft_speedup"] = round(
        statistics.median(uncached) / statistics.median(cached), 2
    )
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def format_report(report: dict) -> str:
    lines = [f"{'system':<34} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}"]
    for run in report["runs"]:
        lines.append(
            f"{run['name']:<34} {run['output_tokens_per_s']:>7} {_ms(run['ttft_p50_s']):>9} "
            f"{_ms(run['ttft_p99_s']):>7} {_ms(run['itl_p50_s']):>8} {_ms(run['itl_p99_s']):>7}"
        )
    for name, ratio in report.get("ratios", {}).items():
        lines.append(f"throughput ratio, ours {name}: {ratio}x")
    if "itl_p50_ratio_vs_transformers_sequential" in report:
        ratio = report["itl_p50_ratio_vs_transformers_sequential"]
        lines.append(f"ITL p50 ratio, transformers sequential / ours: {ratio}x")
    our_runs = report["runs"][-len(report["kv_cache_use"]) :]
    for run, (kv_cache_dtype, floor) in zip(our_runs, report["decode_floor"].items(), strict=False):
        itl_ms = (run["itl_p50_s"] or 0.0) * 1e3
        lines.append(
            f"KV {kv_cache_dtype}: ITL p50 {itl_ms:.1f} ms = "
            f"{itl_ms / floor['floor_ms']:.2f}x the decode step floor {floor['floor_ms']} ms = "
            f"{floor['weight_mb']} MB weights + {floor['kv_mb']} MB KV (mean context "
            f"{floor['mean_context']:.0f}) / {floor['read_gb_per_s']} GB/s read"
        )
    for kv_cache_dtype, kv in report["kv_cache_use"].items():
        lines.append(
            f"KV {kv_cache_dtype}: live tokens / reserved slots, paged blocks mean "
            f"{kv['paged_mean']:.1%} (min {kv['paged_min']:.1%}); contiguous per request, "
            f"the context ({kv['context_len']}) {kv['contiguous_max_context_mean']:.1%}, "
            f"prompt + max_tokens {kv['contiguous_prompt_and_max_tokens_mean']:.1%}"
        )
    if "matmul_ceiling" in report:
        c = report["matmul_ceiling"]
        lines.append(
            f"processed (prompt + output) {c['processed_tokens_per_s']} tok/s = {c['share']:.1%} "
            f"of the bf16 matmul ceiling {c['ceiling_tokens_per_s']} tok/s "
            f"({c['bf16_gflop_per_s']} GFLOP/s on the model's shapes / {c['gflop_per_token']} "
            "GFLOP a token)"
        )
    ttft = report["prefix_cache_ttft_p50_s"]
    lines.append(
        f"held-out shared prefixes ({SHARED_PREFIX_TOKENS} tokens + {QUESTION_TOKENS}, 16 "
        f"requests) TTFT p50: cache off {_ms(ttft['off'])} ms, on {_ms(ttft['on'])} ms"
        f" -> {report['prefix_cache_ttft_speedup']}x"
    )
    lines.append(
        f"CPU flags: {' '.join(report['cpu_flags']) or 'no AVX-512'}; load average "
        f"{report['load_average_before']} before, {report['load_average_after']} after"
    )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


if __name__ == "__main__":
    sys.exit(main())
