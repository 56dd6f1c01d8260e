"""A decode step on two builds of the CPU kernels, alternating in one engine: this checkout's and
another git revision's, so that a kernel change is timed on the same requests, cache and weights.

    python -m bench.kernel_ab --rev REV [--batch 1] [--context 370] [--rounds 12] [--steps 12]
        [--kv-cache-gib 1]

The revision's `engine/kernels/` is extracted beside a temporary directory and built as the
engine builds its own (engine/kernels/__init__.py; a build per CPU and source digest, kept for the
next run). One q4_1 engine holds BATCH requests prefilled to CONTEXT tokens (bench/engine_step.py);
each round runs STEPS decode steps on each build, in turn, the order swapped every round (the
context grows by a token a step, so the one that goes second would always read a little more).
Only the fused decode layers change hands (engine/model/fused_decode.py: one call into the
kernels per step, which holds every decode-step kernel), so only decode steps are compared.
Prints each round's median step per build, their ratio, the median over rounds, the load
average and the CPU flags.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType

from bench.engine_step import build
from bench.report import cpu_vector_flags, load_average
from engine.kernels import build_cpu_kernels, cpu_kernels
from engine.llm_engine import LLMEngine
from engine.model import fused_decode

KERNELS_DIR = "engine/kernels"


def kernels_at(rev: str, workdir: Path) -> ModuleType:
    """The CPU kernels as `rev` has them, built from its sources."""
    archive = subprocess.run(
        ["git", "archive", rev, KERNELS_DIR], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(workdir, filter="data")
    module = build_cpu_kernels(workdir / KERNELS_DIR)
    if module is None:
        raise SystemExit(f"the kernels of {rev} did not build here")
    return module


def step_ms(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the revision to compare with (git)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=370)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=12, help="decode steps per round and build")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = parser.parse_args(argv)
    ours = cpu_kernels()
    if ours is None:
        raise SystemExit("this checkout's CPU kernels are off or did not build")
    load_before = load_average()
    with tempfile.TemporaryDirectory() as workdir:
        theirs = kernels_at(args.rev, Path(workdir))
    builds = {args.rev: theirs, "ours": ours}
    variant = build("q4_1", "smollm2-135m-instruct", args.batch, args.context, args.kv_cache_gib)
    engine = variant.engine
    times: dict[str, list[float]] = {name: [] for name in builds}
    for round_ in range(args.rounds):
        order = list(builds.items()) if round_ % 2 == 0 else list(builds.items())[::-1]
        for name, module in order:
            fused_decode.cpu_kernels = lambda module=module: module  # type: ignore[assignment]
            engine.step()  # the first step on a build after the other's: not timed
            times[name].append(step_ms(engine, args.steps))
        theirs_ms, ours_ms = times[args.rev][-1], times["ours"][-1]
        print(f"round {round_ + 1}: {args.rev} {theirs_ms:.2f} ms, ours {ours_ms:.2f} ms: "
              f"{theirs_ms / ours_ms:.3f}x")  # fmt: skip
    ratios = [a / b for a, b in zip(times[args.rev], times["ours"], strict=True)]
    print(
        f"batch {args.batch}, context {args.context} (+{args.rounds * 2 * (args.steps + 1)} over "
        f"the run): {args.rev} {statistics.median(times[args.rev]):.2f} ms, ours "
        f"{statistics.median(times['ours']):.2f} ms a step; ours faster by "
        f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}x)"
    )
    print(f"load average {load_before} before, {load_average()} after; CPU flags: "
          f"{' '.join(cpu_vector_flags())}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
