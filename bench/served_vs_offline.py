"""Served against offline throughput, with the engine core in the node agent's process and in
its own, all in one run:

    python -m bench.served_vs_offline --concurrency 32 --num-requests 64 --rounds 2 \\
        [--engine-process both|separate|in-process]

It starts one node agent per mode (`python -m node_agent`, `--engine-process` or
`--no-engine-process`) and loads the same engine offline in this process (`engine.LLM`), all with
the same KV pool and batch size. Each round replays the seeded workload (bench/workload.py) once
offline and once against each node agent over HTTP (streaming chat, `ignore_eos`, as
bench/loadgen.py does), the order rotated between rounds so a change in the machine's load falls
on each mode alike, and prints every pass's output tokens/s with its ratio to the same round's
offline pass, and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import httpx

from bench.loadgen import WARMUP_MAX_TOKENS, run_level, time_offline
from bench.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_TOKENS, make_workload
from engine.model_store import DEFAULT_MODEL, resolve_model
from engine.tokenizer import Tokenizer

MODES = {"separate": "--engine-process", "in-process": "--no-engine-process"}
READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Node:
    mode: str
    url: str
    process: subprocess.Popen[bytes]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_node(mode: str, model: str, args: argparse.Namespace) -> Node:
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "node_agent",
        "--model",
        model,
        "--served-model-name",
        args.model,
        "--port",
        str(port),
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--max-num-seqs",
        str(args.concurrency),
        "--log-level",
        "WARNING",
        MODES[mode],
    ]
    return Node(mode, f"http://127.0.0.1:{port}", subprocess.Popen(command))


def _wait_ready(node: Node) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if node.process.poll() is not None:
            raise RuntimeError(f"the {node.mode} node agent exited ({node.process.returncode})")
        try:
            if httpx.get(node.url + "/ready", timeout=5.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the {node.mode} node agent did not become ready")


@contextmanager
def _nodes(modes: list[str], model: str, args: argparse.Namespace) -> Iterator[list[Node]]:
    nodes: list[Node] = []
    try:
        for mode in modes:  # one at a time: two model loads at once only slow each other
            nodes.append(_start_node(mode, model, args))
            _wait_ready(nodes[-1])
        yield nodes
    finally:
        for node in nodes:
            node.process.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (5 min {five:.1f})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.served_vs_offline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--engine-process",
        choices=["both", *MODES],
        default="both",
        help="which node agent modes to serve from (default both)",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM must still stop the node agents (the `finally` of `_nodes`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from engine import LLM

    model = str(resolve_model(args.model))
    workload = make_workload(
        args.num_requests,
        args.seed,
        Tokenizer.from_gguf(model),
        DEFAULT_PROMPT_TOKENS,
        DEFAULT_OUTPUT_TOKENS,
    )
    modes = list(MODES) if args.engine_process == "both" else [args.engine_process]
    print(f"load average at start: {_load()}", flush=True)
    offline_llm = LLM(model, max_num_seqs=args.concurrency, cpu_kv_cache_gib=args.kv_cache_gib)
    warmup = [replace(r, max_tokens=WARMUP_MAX_TOKENS) for r in workload[: args.concurrency]]
    num_errors = 0
    with _nodes(modes, model, args) as nodes:
        for node in nodes:
            level = asyncio.run(
                run_level(node.url, args.model, "unused", warmup, args.concurrency, quiet=True)
            )
            if level.num_errors:
                raise RuntimeError(f"the {node.mode} node's warm-up failed: {level.errors}")
        for round_index in range(args.rounds):
            shift = round_index % (len(nodes) + 1)
            order: list[Node | None] = [None, *nodes]
            order = order[shift:] + order[:shift]
            results: dict[str, float] = {}
            for entry in order:
                if entry is None:
                    offline = time_offline(offline_llm, workload, args.concurrency)
                    results["offline"] = offline["output_tokens_per_s"]
                    continue
                level = asyncio.run(
                    run_level(
                        entry.url, args.model, "unused", workload, args.concurrency, quiet=True
                    )
                )
                num_errors += level.num_errors
                for error in level.errors:
                    print(f"  {entry.mode} error: {error}", file=sys.stderr)
                results[entry.mode] = level.output_tokens_per_s
            cells = [f"offline {results['offline']:.1f} tok/s"]
            cells += [
                f"{mode} {results[mode]:.1f} tok/s ({results[mode] / results['offline']:.1%})"
                for mode in modes
            ]
            if len(modes) == 2:
                ratio = results["separate"] / results["in-process"]
                cells.append(f"separate/in-process {ratio:.2f}x")
            print(
                f"round {round_index + 1} (c={args.concurrency}, load {_load()}): "
                + ", ".join(cells),
                flush=True,
            )
    print(f"load average at end: {_load()}")
    return 1 if num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
