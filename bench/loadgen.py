"""Load generator: replays the seeded workload against any OpenAI-compatible endpoint.

    python -m bench.loadgen --url http://127.0.0.1:9001 --model smollm2-135m-instruct \\
        --concurrency 1 8 32 --num-requests 64 [--offline] [--json]

Every request is a streaming chat completion with `max_tokens` and `"ignore_eos": true` (as vLLM
accepts it), so each generates exactly its planned length. For each concurrency level it prints
output tokens/s, TTFT and inter-token latency p50/p99 and the errors (progress on stderr).
`--offline` first runs the same workload through the engine in this process (`engine.LLM`, batch
up to the highest concurrency), so served throughput can be compared with it in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import aiohttp

from bench.workload import WorkloadRequest, make_workload
from engine.model_store import DEFAULT_MODEL, resolve_model
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine import LLM

REQUEST_TIMEOUT_S = 600.0
WARMUP_MAX_TOKENS = 4


@dataclass(slots=True)
class RequestResult:
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class LevelSummary:
    concurrency: int
    num_requests: int
    num_errors: int
    duration_s: float
    num_output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    errors: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linearly interpolated; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    request: WorkloadRequest,
    temperature: float,
) -> RequestResult:
    body = {
        "model": model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "ignore_eos": True,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    started = last = time.perf_counter()
    num_chunks = 0
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                usage = chunk.get("usage")
                if usage:
                    result.num_output_tokens = int(usage["completion_tokens"])
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("delta", {}).get("content"):
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - started
                else:
                    result.itl_s.append(now - last)
                last = now
                num_chunks += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not result.num_output_tokens:
        result.num_output_tokens = num_chunks
    return result


async def run_level(
    url: str,
    model: str,
    api_key: str,
    workload: list[WorkloadRequest],
    concurrency: int,
    temperature: float = 0.0,
    quiet: bool = False,
) -> LevelSummary:
    """Replay `workload` with at most `concurrency` requests in flight."""
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    results: list[RequestResult] = []
    queue = list(reversed(workload))

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            request = queue.pop()
            results.append(await send_one(session, endpoint, model, request, temperature))
            if not quiet and (len(results) % max(1, len(workload) // 10) == 0):
                print(
                    f"  c={concurrency}: {len(results)}/{len(workload)} done",
                    file=sys.stderr,
                    flush=True,
                )

    started = time.perf_counter()
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(workload)))))
    duration_s = time.perf_counter() - started
    return summarize(concurrency, results, duration_s)


def summarize(concurrency: int, results: list[RequestResult], duration_s: float) -> LevelSummary:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    num_tokens = sum(r.num_output_tokens for r in ok)
    errors = sorted({r.error for r in results if r.error is not None})
    return LevelSummary(
        concurrency=concurrency,
        num_requests=len(results),
        num_errors=len(results) - len(ok),
        duration_s=duration_s,
        num_output_tokens=num_tokens,
        output_tokens_per_s=num_tokens / duration_s if duration_s > 0 else 0.0,
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        errors=errors[:5],
    )


def run_offline(model: str, workload: list[WorkloadRequest], max_num_seqs: int) -> dict[str, float]:
    """The engine's own throughput on the same workload, in this process (no HTTP)."""
    from engine import LLM

    return time_offline(LLM(model, max_num_seqs=max_num_seqs), workload, max_num_seqs)


def time_offline(llm: LLM, workload: list[WorkloadRequest], max_num_seqs: int) -> dict[str, float]:
    """One offline pass of `workload` through a loaded `llm`, after an unmeasured warm-up."""
    from engine import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in workload]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload
    ]
    warmup = prompts[:max_num_seqs]  # unmeasured, as the served run's warm-up
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=WARMUP_MAX_TOKENS))
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    duration_s = time.perf_counter() - started
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "max_num_seqs": max_num_seqs,
        "duration_s": duration_s,
        "num_output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / duration_s,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_table(levels: list[LevelSummary], offline: dict[str, float] | None) -> str:
    lines = [
        f"{'conc':>4} {'reqs':>5} {'errors':>6} {'out tok/s':>9} {'req/s':>6} "
        f"{'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'ITL p50 ms':>10} {'ITL p99 ms':>10}"
    ]
    for s in levels:
        lines.append(
            f"{s.concurrency:>4} {s.num_requests:>5} {s.num_errors:>6} "
            f"{s.output_tokens_per_s:>9.1f} {s.requests_per_s:>6.2f} {_ms(s.ttft_p50_s):>11} "
            f"{_ms(s.ttft_p99_s):>11} {_ms(s.itl_p50_s):>10} {_ms(s.itl_p99_s):>10}"
        )
        lines.extend(f"       error: {e}" for e in s.errors)
    if offline is not None:
        lines.append(
            f"offline engine (batch <= {offline['max_num_seqs']:.0f}): "
            f"{offline['output_tokens_per_s']:.1f} out tok/s"
        )
        if levels:
            best = levels[-1]
            ratio = best.output_tokens_per_s / offline["output_tokens_per_s"]
            lines.append(f"served/offline at concurrency {best.concurrency}: {ratio:.1%}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loadgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:9001")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the `model` field to send")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-requests", type=int, default=64, help="per concurrency level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        default=DEFAULT_MODEL,
        help="model name or GGUF path whose tokenizer sizes the prompts",
    )
    parser.add_argument("--min-prompt-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--min-output-tokens", type=int, default=16)
    parser.add_argument("--max-output-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--offline",
        action="store_true",
        help="also measure the engine offline on the same workload (loads it)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the unmeasured warm-up (the first requests, 4 tokens each)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if any(c < 1 for c in args.concurrency) or args.num_requests < 1:
        print("loadgen: error: concurrency and num-requests must be >= 1", file=sys.stderr)
        return 2
    tokenizer_path = resolve_model(args.tokenizer)
    tokenizer = Tokenizer.from_gguf(tokenizer_path)
    workload = make_workload(
        args.num_requests,
        args.seed,
        tokenizer,
        (args.min_prompt_tokens, args.max_prompt_tokens),
        (args.min_output_tokens, args.max_output_tokens),
    )
    offline = None
    if args.offline:
        print("offline engine run ...", file=sys.stderr, flush=True)
        offline = run_offline(str(tokenizer_path), workload, max(args.concurrency))
    if args.warmup:
        top = max(args.concurrency)
        print(f"warm-up: {min(top, len(workload))} requests", file=sys.stderr, flush=True)
        short = [replace(r, max_tokens=WARMUP_MAX_TOKENS) for r in workload[:top]]
        asyncio.run(run_level(args.url, args.model, args.api_key, short, top, quiet=True))
    levels = []
    for concurrency in args.concurrency:
        print(f"concurrency {concurrency}: {len(workload)} requests", file=sys.stderr, flush=True)
        levels.append(
            asyncio.run(
                run_level(
                    args.url, args.model, args.api_key, workload, concurrency, args.temperature
                )
            )
        )
    if args.json:
        report = {
            "url": args.url,
            "model": args.model,
            "seed": args.seed,
            "num_requests": len(workload),
            "mean_prompt_tokens": sum(r.num_prompt_tokens for r in workload) / len(workload),
            "mean_output_tokens": sum(r.max_tokens for r in workload) / len(workload),
            "offline": offline,
            "levels": [asdict(s) for s in levels],
        }
        print(json.dumps(report, indent=2))
    else:
        print(format_table(levels, offline))
    return 1 if any(s.num_errors for s in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
