"""Parallel worker processes: ranks 1..TP*PP-1, each running its shard of every step.

The driver (rank 0, inside the engine) owns the scheduler and the block pool. Each step it
sends each batch's inputs down a pipe to every worker; every rank runs its shard of its stage,
the TP shards of a stage meet in the model's all-reduces, and the stages pass activations on
(engine/pipeline.py). A pipe, unlike a collective, lets an idle worker wait for
the next step as long as the engine idles, and tells it at once when the driver is gone.
Workers are spawned, never forked, so CUDA and OpenMP start clean in each. A spawned worker
first imports the driver's main module again; the driver waits for each to say it has started
and set up its device before it joins the process group, so that a worker dying in that import
(a script without the `if __name__ == "__main__":` guard) fails the engine at once instead of
leaving the driver waiting for a rank that will never come, and the driver's own wait at the
rendezvous is short. Workers beat while they start, and one that falls silent (stopped, hung)
fails the start within `step_timeout_s` (engine/worker_start.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import socket
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist

from engine.distributed import init_groups
from engine.errors import EngineDeadError
from engine.loader import load_checkpoint
from engine.model_runner import ModelRunner, RunnerShape
from engine.pipeline import PipelineStage, StageWork, stage_layers
from engine.worker_start import JOINING, READY, STARTED, StartReporter, StartWatch

_JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ParallelSpec:
    """Everything a rank needs to build its shard."""

    checkpoint: str
    shape: RunnerShape
    tp_size: int
    pp_size: int
    init_method: str
    step_timeout_s: float  # also how long a starting worker may stay silent
    start_timeout_s: float  # loading weights (and building the CPU kernel) on every rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rank_device(shape: RunnerShape, rank: int) -> torch.device:
    return torch.device("cuda", rank) if shape.device.type == "cuda" else shape.device


def rank_name(spec: ParallelSpec, rank: int) -> str:
    stage, tp_rank = divmod(rank, spec.tp_size)
    return f"rank {rank} (pipeline stage {stage}, TP rank {tp_rank})"


def share_cpu_threads(size: int) -> None:
    # Ranks on one CPU split its cores; more threads than cores only makes them wait on each other.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def set_up_device(spec: ParallelSpec, rank: int) -> torch.device:
    device = rank_device(spec.shape, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        share_cpu_threads(spec.world_size)
    return device


def build_stage(
    spec: ParallelSpec, rank: int, device_shape: RunnerShape, rendezvous_timeout_s: float
) -> PipelineStage:
    """Join the groups (the device set up already) and load this rank's shard of its stage's
    layers."""
    tp, pp = init_groups(
        rank,
        spec.tp_size,
        spec.pp_size,
        spec.init_method,
        device_shape.device,
        spec.step_timeout_s,
        rendezvous_timeout_s,
    )
    checkpoint = load_checkpoint(Path(spec.checkpoint))
    layers = stage_layers(checkpoint.config, spec.pp_size, pp.stage)
    return PipelineStage(ModelRunner(checkpoint, device_shape, tp, layers), pp)


class Workers:
    """The driver's handle on ranks 1..TP*PP-1; built once every worker has started and is
    joining the process group."""

    def __init__(self, spec: ParallelSpec):
        self.spec = spec
        context = mp.get_context("spawn")
        self.processes: list[BaseProcess] = []
        self.pipes: list[Connection] = []
        for rank in range(1, spec.world_size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_worker_main,
                args=(spec, rank, theirs),
                name=rank_name(spec, rank),
                daemon=True,
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        atexit.register(self.shutdown)
        self._start = StartWatch(
            self.pipes, self.processes, spec.step_timeout_s, spec.start_timeout_s
        )
        self.follow_start(STARTED)
        self.follow_start(JOINING)

    def follow_start(self, message: str) -> None:
        """Wait until every worker has sent `message` (engine/worker_start.py); a start that
        fails stops every worker."""
        try:
            self._start.wait_for(message)
        except BaseException:
            self.kill()
            raise

    def send(self, message: StageWork | int | None) -> None:
        """To every worker: the KV block count once, then each batch, then None to stop."""
        self.raise_if_dead()
        try:
            for pipe in self.pipes:
                pipe.send(message)
        except (BrokenPipeError, ConnectionResetError) as exc:
            self.raise_if_dead()
            raise EngineDeadError(f"lost a parallel worker: {exc}") from exc

    def fail_start(self) -> None:
        """The driver's own part of the start failed: stop every worker, raising
        WorkerStartupError instead if a worker made it fail (it exited or fell silent)."""
        try:
            self._start.raise_if_failed()
        finally:
            self.kill()

    def wait_ready(self) -> None:
        """Wait until every worker has its weights and cache: the first step's collectives
        then start together, and only a rank that dies or hangs can make them time out."""
        self.follow_start(READY)

    def raise_if_dead(self, grace_s: float = 0.0) -> None:
        """EngineDeadError naming the dead workers, if any. A step that failed may have seen a
        killed peer's socket reset a moment before the peer finished exiting: `grace_s` waits
        that long for one to exit, so the error names it rather than the reset."""
        deadline = time.monotonic() + grace_s
        # Polled as well as waited on: a killed worker's sentinel can stay open while a process
        # it started still holds the pipe, though the worker itself is gone.
        while not (dead := [p for p in self.processes if not p.is_alive()]):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return
            wait_for_connections([p.sentinel for p in self.processes], timeout=min(left_s, 0.05))
        names = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
        raise EngineDeadError(f"parallel worker died: {names}")

    def shutdown(self) -> None:
        """Tell the workers to stop, then make sure they have: no process outlives us."""
        atexit.unregister(self.shutdown)
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # that worker may already be gone
                pipe.send(None)
            pipe.close()
        self.pipes = []
        for process in self.processes:
            process.join(_JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        """Stop every worker now: for a start that failed, when none can be doing work."""
        atexit.unregister(self.shutdown)
        for pipe in self.pipes:
            pipe.close()
        self.pipes = []
        for process in self.processes:
            process.kill()
            process.join()


def _worker_main(spec: ParallelSpec, rank: int, pipe: Connection) -> None:
    reporter = StartReporter(pipe)
    reporter.started()
    logging.basicConfig(level=logging.WARNING)
    device_shape = replace(spec.shape, device=set_up_device(spec, rank))
    reporter.joining()
    # The driver enters the rendezvous once every worker is joining, after its own device.
    stage = build_stage(spec, rank, device_shape, rendezvous_timeout_s=spec.start_timeout_s)
    try:
        num_blocks = pipe.recv()
        assert isinstance(num_blocks, int), "the driver sends the KV block count first"
        stage.runner.allocate_kv_cache(num_blocks)
        reporter.ready()
        while (message := pipe.recv()) is not None:
            stage.forward(message)
    except EOFError:
        pass  # the driver is gone; so is the group
    else:
        dist.destroy_process_group()
    os._exit(0)  # as the engine core leaves (engine/core_process.py): no interpreter teardown
