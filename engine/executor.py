"""Runs batches: on one rank, or as the driver (rank 0) of tensor- and pipeline-parallel ranks.

`submit` starts a batch and `collect` returns the oldest one's sampled tokens, so that with a
pipeline several batches can be in flight at once; with one stage a batch is collected right
after it is submitted.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.cuda_graphs import DecodeGraphs, graphs_enabled
from engine.distributed import PPGroup, valid_tp_sizes
from engine.errors import EngineDeadError, UnsupportedModelError
from engine.input_batch import InputBatch
from engine.loader import Checkpoint
from engine.model_runner import ModelRunner, RunnerShape
from engine.pipeline import PipelineStage, StageWork, stage_layers
from engine.sampler import SamplerOutput, SamplingRequest, sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.workers import ParallelSpec, Workers, build_stage, free_init_method, set_up_device

# Loading weights (and building the CPU kernel the first time) on every rank.
_START_TIMEOUT_S = 600.0
_DEATH_GRACE_S = 3.0  # how long a failed step waits for a dying worker to finish exiting


@dataclass(slots=True)
class StepOutput:
    """The sequences that reached the end of their tokens this step, each with its new token."""

    seqs: list[Sequence]
    sampled: SamplerOutput


@dataclass(slots=True)
class _InFlight:
    batch: ScheduledBatch
    work: StageWork
    seqs: list[Sequence]  # owed a sampled token, in logits-row order
    logits: torch.Tensor | None  # known at once where the driver is also the last stage


class ModelExecutor:
    def __init__(
        self,
        checkpoint: Checkpoint,
        shape: RunnerShape,
        tp_size: int,
        pp_size: int,
        step_timeout_s: float,
    ):
        config = checkpoint.config
        if tp_size not in valid_tp_sizes(config.num_heads, config.num_kv_heads, limit=tp_size):
            raise UnsupportedModelError(
                f"tensor_parallel_size {tp_size} does not split {config.num_heads} attention "
                f"heads and {config.num_kv_heads} KV heads; valid sizes: "
                f"{valid_tp_sizes(config.num_heads, config.num_kv_heads)}"
            )
        if not 1 <= pp_size <= config.num_layers:
            raise UnsupportedModelError(
                f"pipeline_parallel_size {pp_size} must be between 1 and the model's "
                f"{config.num_layers} layers"
            )
        self.in_flight: deque[_InFlight] = deque()
        self.eos_token_ids = checkpoint.tokenizer.stop_token_ids  # held back by min_tokens
        self._tags = itertools.count()
        # The largest stage sets the per-rank bytes of a block; every rank has as many blocks.
        self.max_stage_layers = max(len(stage_layers(config, pp_size, s)) for s in range(pp_size))
        self.workers: Workers | None = None
        self.max_model_len = shape.max_model_len
        self.decode_graphs: DecodeGraphs | None = None
        self.input_batch: InputBatch | None = None  # sized in allocate_kv_cache
        if tp_size * pp_size == 1:
            self.stage = PipelineStage(ModelRunner(checkpoint, shape), PPGroup())
            return
        spec = ParallelSpec(
            str(checkpoint.path),
            shape,
            tp_size,
            pp_size,
            free_init_method(),
            step_timeout_s,
            _START_TIMEOUT_S,
        )
        self.workers = Workers(spec)
        set_up_device(spec, 0)
        try:
            # Every worker is at the rendezvous already: a short wait there, or one stopped.
            self.stage = build_stage(spec, 0, shape, rendezvous_timeout_s=step_timeout_s)
        except BaseException:
            self.workers.fail_start()
            raise

    @property
    def runner(self) -> ModelRunner:
        return self.stage.runner

    @property
    def kv_bytes_per_block(self) -> int:
        """Per rank: each holds its share of the KV heads of its stage's layers."""
        return self.runner.kv_bytes_per_block_per_layer * self.max_stage_layers

    def allocate_kv_cache(self, num_blocks: int, max_num_seqs: int) -> None:
        """`num_blocks` for the pool; where decode steps are captured as CUDA graphs, one more
        beyond it, the scratch block their padding rows write to."""
        if self.workers is not None:
            self.workers.send(num_blocks)
        runner = self.runner
        self.input_batch = InputBatch(
            max_num_seqs, self.max_model_len, runner.block_size, runner.use_decode_kernel
        )
        if graphs_enabled(self.runner, self.workers is None):
            self.runner.allocate_kv_cache(num_blocks + 1)
            self.decode_graphs = DecodeGraphs(
                self.runner, max_num_seqs, self.max_model_len, scratch_block=num_blocks
            )
            self.decode_graphs.capture()
        else:
            self.runner.allocate_kv_cache(num_blocks)
        if self.workers is not None:
            self.workers.wait_ready()

    def submit(self, batch: ScheduledBatch) -> None:
        """Start `batch` down the pipeline: send it to every worker and run the first stage."""
        assert self.input_batch is not None, "allocate_kv_cache comes before the first batch"
        inputs, seqs = self.input_batch.prepare(batch)
        work = StageWork(next(self._tags) % 2**31, inputs)
        with self._failing_loudly():
            if self.workers is not None:
                self.workers.send(work)
            if self.decode_graphs is not None and self.decode_graphs.can_run(inputs):
                logits: torch.Tensor | None = self.decode_graphs.run(inputs)
            else:
                logits = self.stage.forward(work)
        self.in_flight.append(_InFlight(batch, work, seqs, logits))

    def collect(self) -> tuple[ScheduledBatch, StepOutput]:
        """Wait for the oldest batch in flight; return it with its sampled tokens."""
        done = self.in_flight.popleft()
        logits = done.logits
        if logits is None:
            with self._failing_loudly():
                logits = self.stage.receive_logits(done.work)
        if not done.seqs:
            return done.batch, StepOutput([], SamplerOutput([], []))
        requests = [
            SamplingRequest(s.params, s.num_output_tokens, s.token_ids, s.grammar)
            for s in done.seqs
        ]
        return done.batch, StepOutput(done.seqs, sample(logits, requests, self.eos_token_ids))

    @contextmanager
    def _failing_loudly(self) -> Iterator[None]:
        """A collective or a receive that fails means a rank died or hung: say which."""
        try:
            yield
        except RuntimeError as exc:
            if self.workers is None:
                raise
            self.workers.raise_if_dead(grace_s=_DEATH_GRACE_S)
            raise EngineDeadError(f"a parallel step failed: {exc}") from exc

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
