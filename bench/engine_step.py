"""The time of one decode step, A/B in one process: rounds of steps alternate between variants,
so that the load of a shared machine falls on each about evenly.

    python -m bench.engine_step [--batch 1] [--context 256] [--rounds 5] [--steps 8]
        [--kv-cache-gib 0.25]
        [--variants adaptive threads=1 threads=2 int8 q4_1 q4_1-float-head fixed-64 ...]

Each variant is its own engine with BATCH requests prefilled to CONTEXT tokens (greedy,
`ignore_eos`). `adaptive` is the engine with float weights (`quantization="none"`: the model's
dtype; the thread count chosen per step, see engine/step_threads.py), as is every variant not
named for a quantization; `threads=N` pins it; `int8` is `quantization="int8"` and `q4_1`
`quantization="q4_1"` (the GGUF's Q4_1 blocks kept, the LM head's Q8_0 blocks too), both with
adaptive threads; `q4_1-float-head` is q4_1 with the LM head read in the model's dtype;
`layers` and `q4_1-layers` run each decode step's layers one module at a time instead of the
fused call (engine/model/fused_decode.py; so do `eager`, `torch-mm` and the compiled ones);
`eager` is the default with the fused CPU layer ops swapped for their eager twins;
`torch-mm` is the default with our bf16 GEMV kernel swapped for `F.linear`; `gemv-4` the default
with that kernel for steps of up to 4 tokens only, as on CPUs with AMX; `fixed-64` (and
`q4_1-fixed-64`) with the kernel's range fixed at 64 tokens on every shape and the blocks read up to
8, the layer dequantized above (the rule before the range was measured per shape); `rebuild` is the
default with each step's inputs built from the sequences alone (`build_step_inputs`, the path before
the persistent input batch); `compile` is the default with its decode steps' forward under
torch.compile and the fused layer ops left to inductor, `compile-fused` the same keeping our fused
ops (bench/compiled_model.py), and `q4_1-compile`, `q4_1-compile-fused` those on q4_1; their first
steps (the compiles) run before the rounds, and their time and Dynamo's counts are printed.
Prints each round's median step time per variant and, per round, each variant against the
first, with the median time of preparing the step's inputs (inside the step time) and its
share; the load average and CPU flags beside them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from unittest import mock

import torch

from bench.report import load_average, machine, report_out
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.block_weights import BlockWeight
from engine.model_runner import StepInputs
from engine.model_store import DEFAULT_MODEL, pull
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.step_threads import StepThreadPolicy


@dataclass(slots=True)
class Variant:
    name: str
    engine: LLMEngine
    context: Callable[[], AbstractContextManager[object]] = nullcontext
    compile_s: float | None = None  # the compiled variants' warm-up: the first steps' time
    prepare_s: list[float] = field(default_factory=list)  # each step's input preparation


def time_prepare(variant: Variant) -> None:
    """Record how long each step's input preparation takes (rebuild: the one-off build)."""
    executor = variant.engine.executor
    assert executor.input_batch is not None
    prepare = executor.runner.prepare if variant.name == "rebuild" else executor.input_batch.prepare

    def timed(batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        started = time.perf_counter()
        out = prepare(batch)
        variant.prepare_s.append(time.perf_counter() - started)
        return out

    executor.input_batch.prepare = timed  # type: ignore[method-assign]


def build(name: str, model: str, batch: int, context: int, kv_gib: float) -> Variant:
    variant = build_engine(name, model, batch, context, kv_gib)
    time_prepare(variant)
    return variant


def build_engine(name: str, model: str, batch: int, context: int, kv_gib: float) -> Variant:
    quantization = "q4_1" if name.startswith("q4_1") else name if name == "int8" else "none"
    config = EngineConfig(model, cpu_kv_cache_gib=kv_gib, quantization=quantization)
    engine = LLMEngine(config)
    runner = engine.executor.runner
    pinned = None
    if name == "q4_1-float-head":
        head = runner.model.lm_head or runner.model.embed_tokens
        assert head is not None
        head.head_blocks = None
    if name.startswith("threads="):
        runner.step_threads, pinned = None, int(name.split("=")[1])
    if name.endswith("layers") or name in ("eager", "torch-mm") or "compile" in name:
        runner.fused_decode = None  # the layers' modules, which these variants swap ops in
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (7 * i + j) % 40_000 for j in range(context)]
        engine.add_request(f"{name}-{i}", prompt, params)
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    if "compile" in name:
        return compiled(name, engine)
    if name == "eager":
        return Variant(
            name, engine, lambda: mock.patch("engine.model.layer_ops._kernels_for", lambda x: None)
        )
    if name == "torch-mm":
        return Variant(
            name,
            engine,
            lambda: mock.patch("engine.model.dense_matmul._kernels_for", lambda x: None),
        )
    if name.endswith("gemv-4"):
        return Variant(name, engine, gemv_4)
    if name.endswith("fixed-64"):
        return Variant(name, engine, fixed_64)
    if pinned is not None:
        return Variant(name, engine, lambda: threads(pinned))
    return Variant(name, engine)


@contextmanager
def gemv_4() -> Iterator[None]:
    """The bf16 GEMV kernel for steps of up to 4 tokens only: its range before it followed the
    CPU (AMX CPUs still run it)."""
    with mock.patch("engine.model.dense_matmul.bf16_gemv_max_tokens", lambda n, k: 4):
        yield


@contextmanager
def fixed_64() -> Iterator[None]:
    """The bf16 GEMV kernel up to 64 tokens on every shape, the blocks up to 8."""
    with (
        mock.patch("engine.model.dense_matmul.bf16_gemv_max_tokens", lambda n, k: 64),
        mock.patch.object(BlockWeight, "max_kernel_tokens", lambda self: 8),
    ):
        yield


def compiled(name: str, engine: LLMEngine, num_warmup_steps: int = 4) -> Variant:
    from bench.compiled_model import compile_decodes, compile_stats, kernel_ops

    fused = name.endswith("compile-fused")
    runner = engine.executor.runner
    # Each layer's K and V in a tensor of its own: as views of the runner's one cache tensor,
    # they are graph inputs that alias each other, and a mutation of such an input is
    # functionalized into copies (seconds a step with our KV-writing op, under the whole cache).
    runner.kv_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    compile_decodes(runner.model)
    started = time.perf_counter()
    with kernel_ops(fused):
        for _ in range(num_warmup_steps):
            engine.step()
    compile_s = time.perf_counter() - started
    # The compile's minute-long steps would make the thread policy shun the count they ran on.
    runner.step_threads = StepThreadPolicy.for_this_process()
    print(f"{name}: {num_warmup_steps} warm-up steps {compile_s:.1f} s, {compile_stats()}")
    return Variant(name, engine, lambda: kernel_ops(fused), compile_s)


@contextmanager
def threads(num_threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def time_steps(variant: Variant, num_steps: int) -> tuple[float, float]:
    """Median step and input-preparation times (ms) over `num_steps` steps."""
    times = []
    variant.prepare_s.clear()
    with variant.context():
        for _ in range(num_steps):
            started = time.perf_counter()
            variant.engine.step()
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, statistics.median(variant.prepare_s) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per round and variant")
    parser.add_argument("--variants", nargs="+", default=["adaptive", "threads=1", "threads=2"])
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="per variant")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = str(pull(DEFAULT_MODEL))
    variants = [
        build(name, model, args.batch, args.context, args.kv_cache_gib) for name in args.variants
    ]
    load_before = load_average()
    rounds, prepare_rounds = [], []
    for _ in range(args.rounds):
        timed = {v.name: time_steps(v, args.steps) for v in variants}
        ms = {n: step for n, (step, _) in timed.items()}
        rounds.append(ms)
        prepare_rounds.append({n: prep for n, (_, prep) in timed.items()})
        first = args.variants[0]
        print(
            "  ".join(
                f"{n} {t:.1f} ms ({ms[first] / t:.2f}x; prepare {p:.3f} ms, {p / t:.1%})"
                for n, (t, p) in timed.items()
            ),
            flush=True,
        )
    report = {
        "batch": args.batch,
        "context": args.context,
        "rounds_ms": rounds,
        "median_ms": {n: statistics.median(r[n] for r in rounds) for n in args.variants},
        "prepare_rounds_ms": prepare_rounds,
        **machine(load_before),
        "compile_s": {v.name: v.compile_s for v in variants if v.compile_s is not None},
    }
    if any("compile" in n for n in args.variants):
        from bench.compiled_model import compile_stats

        report["compile_stats"] = compile_stats()
    summary = ("median_ms", "load_average", "compile_s", "compile_stats", "cpu_flags")
    report_out(report, args.json, summary)
    for v in variants:
        v.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
