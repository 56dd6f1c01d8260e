"""Runs each step: on one rank, or as the driver (rank 0) of tensor- and pipeline-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

from engine.distributed import PPGroup, valid_tp_sizes
from engine.errors import EngineDeadError, UnsupportedModelError
from engine.loader import Checkpoint
from engine.model_runner import ModelRunner, RunnerShape
from engine.pipeline import PipelineStage, split_micro_batches, stage_layers
from engine.sampler import SamplerOutput, SamplingRequest, sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.workers import ParallelSpec, Workers, build_stage, free_init_method

# Loading weights (and building the CPU kernel the first time) on every rank.
_START_TIMEOUT_S = 600.0


@dataclass(slots=True)
class StepOutput:
    """The sequences that reached the end of their tokens this step, each with its new token."""

    seqs: list[Sequence]
    sampled: SamplerOutput


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
        self.pp_size = pp_size
        # The largest stage sets the per-rank bytes of a block; every rank has as many blocks.
        self.max_stage_layers = max(len(stage_layers(config, pp_size, s)) for s in range(pp_size))
        self.workers: Workers | None = None
        if tp_size * pp_size == 1:
            self.stage = PipelineStage(ModelRunner(checkpoint, shape), PPGroup())
            return
        spec = ParallelSpec(
            str(checkpoint.path), shape, tp_size, pp_size, free_init_method(), step_timeout_s
        )
        self.workers = Workers(spec)
        self.stage = build_stage(spec, 0, shape)

    @property
    def runner(self) -> ModelRunner:
        return self.stage.runner

    @property
    def kv_bytes_per_block(self) -> int:
        """Per rank: each holds its share of the KV heads of its stage's layers."""
        return self.runner.kv_bytes_per_block_per_layer * self.max_stage_layers

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.workers is not None:
            self.workers.send(num_blocks)
        self.runner.allocate_kv_cache(num_blocks)
        if self.workers is not None:
            self.workers.wait_ready(_START_TIMEOUT_S)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        micro_batches = [self.runner.prepare(b) for b in split_micro_batches(batch, self.pp_size)]
        inputs = [i for i, _ in micro_batches]
        seqs = [s for _, mb_seqs in micro_batches for s in mb_seqs]
        try:
            if self.workers is not None:
                self.workers.send(inputs)
            logits = self.stage.run(inputs)
        except RuntimeError as exc:  # a collective or a receive failed: name the rank if one died
            if self.workers is None:
                raise
            self.workers.raise_if_dead()
            raise EngineDeadError(f"a parallel step failed: {exc}") from exc
        if not seqs:
            return StepOutput([], SamplerOutput([], []))
        assert logits is not None, "the driver always ends a step with the logits"
        requests = [SamplingRequest(s.params, s.num_output_tokens) for s in seqs]
        return StepOutput(seqs, sample(logits, requests))

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
