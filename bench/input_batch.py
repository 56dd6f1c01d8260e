"""A step's input preparation alone, A/B in one process: the one-off build from the sequences
(`build_step_inputs`, what every step did before) against the persistent input batch.

    python -m bench.input_batch [--batches 1 8 32 64] [--contexts 256 1024] [--steps 200]

For each batch size and context, BATCH sequences decode together from CONTEXT tokens (block
size 16); every step both variants prepare the same batch, in alternating order, and then the
sequences advance (a new token each, a new block every 16 steps). No model runs: this is the
Python and tensor-building cost that the step's time contains. Prints the median of each and the
ratio, with the load average and CPU flags.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from bench.report import load_average, machine, report_out
from engine.input_batch import InputBatch
from engine.model_runner import StepInputs, build_step_inputs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

BLOCK_SIZE = 16
Prepare = Callable[[ScheduledBatch], tuple[StepInputs, list[Sequence]]]


def decoding_batch(batch_size: int, context: int, num_steps: int) -> list[Sequence]:
    """Sequences with `context` computed tokens and a sampled one to decode, each with its
    own blocks (room for `num_steps` more tokens)."""
    num_blocks = -(-(context + num_steps + 1) // BLOCK_SIZE)
    seqs = []
    for i in range(batch_size):
        seq = Sequence(f"s{i}", [100 + (i + j) % 900 for j in range(context)], SamplingParams(), 1)
        seq.token_ids.append(7)
        seq.num_computed_tokens = context
        seq.block_table = list(
            range(i * num_blocks, i * num_blocks + -(-seq.num_tokens // BLOCK_SIZE))
        )
        seqs.append(seq)
    return seqs


def measure(batch_size: int, context: int, num_steps: int) -> dict[str, float]:
    seqs = decoding_batch(batch_size, context, num_steps)
    num_blocks = -(-(context + num_steps + 1) // BLOCK_SIZE)
    rows = InputBatch(batch_size, context + num_steps + 1, BLOCK_SIZE, use_decode_kernel=True)
    variants: dict[str, Prepare] = {
        "rebuild": lambda b: build_step_inputs(b, BLOCK_SIZE, True),
        "persistent": rows.prepare,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(num_steps):
        batch = ScheduledBatch(seqs, [1] * batch_size)
        order = list(variants) if step % 2 else list(reversed(variants))
        for name in order:
            started = time.perf_counter()
            variants[name](batch)
            times[name].append(time.perf_counter() - started)
        for i, seq in enumerate(seqs):
            seq.num_computed_tokens += 1
            seq.token_ids.append(7)
            if seq.num_tokens > len(seq.block_table) * BLOCK_SIZE:
                seq.block_table.append(i * num_blocks + len(seq.block_table))
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    return {**us, "ratio": us["rebuild"] / us["persistent"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    load_before = load_average()
    results = []
    for context in args.contexts:
        for batch_size in args.batches:
            r = measure(batch_size, context, args.steps)
            results.append({"batch": batch_size, "context": context, **r})
            print(
                f"batch {batch_size:3d} context {context:5d}: rebuild {r['rebuild']:7.1f} us  "
                f"persistent {r['persistent']:7.1f} us  ({r['ratio']:.2f}x)",
                flush=True,
            )
    report = {
        "results": results,
        **machine(load_before),
    }
    report_out(report, args.json, ("load_average",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
