"""Runs each step: on one rank, or as the driver (rank 0) of a tensor-parallel group."""

from __future__ import annotations

from dataclasses import dataclass

from engine.distributed import valid_tp_sizes
from engine.errors import EngineDeadError, UnsupportedModelError
from engine.loader import Checkpoint
from engine.model_runner import ModelRunner, RunnerShape
from engine.sampler import SamplerOutput, SamplingRequest, sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.tp_workers import TPSpec, TPWorkers, free_init_method, join_group

# Loading weights (and building the CPU kernel the first time) on every rank.
_START_TIMEOUT_S = 600.0


@dataclass(slots=True)
class StepOutput:
    """The sequences that reached the end of their tokens this step, each with its new token."""

    seqs: list[Sequence]
    sampled: SamplerOutput


class ModelExecutor:
    def __init__(
        self, checkpoint: Checkpoint, shape: RunnerShape, tp_size: int, step_timeout_s: float
    ):
        config = checkpoint.config
        if tp_size not in valid_tp_sizes(config.num_heads, config.num_kv_heads, limit=tp_size):
            raise UnsupportedModelError(
                f"tensor_parallel_size {tp_size} does not split {config.num_heads} attention "
                f"heads and {config.num_kv_heads} KV heads; valid sizes: "
                f"{valid_tp_sizes(config.num_heads, config.num_kv_heads)}"
            )
        self.workers: TPWorkers | None = None
        tp = None
        if tp_size > 1:
            spec = TPSpec(str(checkpoint.path), shape, tp_size, free_init_method(), step_timeout_s)
            self.workers = TPWorkers(spec)
            tp = join_group(spec, 0)
        self.runner = ModelRunner(config, checkpoint.tensors(), shape, tp)

    @property
    def kv_bytes_per_block(self) -> int:
        """Per rank: each holds its share of the KV heads."""
        return self.runner.kv_bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.workers is not None:
            self.workers.send(num_blocks)
        self.runner.allocate_kv_cache(num_blocks)
        if self.workers is not None:
            self.workers.wait_ready(_START_TIMEOUT_S)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        inputs, seqs = self.runner.prepare(batch)
        try:
            if self.workers is not None:
                self.workers.send(inputs)
            logits = self.runner.run(inputs)
        except RuntimeError as exc:  # a collective failed: name the rank if one died
            if self.workers is None:
                raise
            self.workers.raise_if_dead()
            raise EngineDeadError(f"a tensor-parallel step failed: {exc}") from exc
        if not seqs:
            return StepOutput([], SamplerOutput([], []))
        requests = [SamplingRequest(s.params, s.num_output_tokens) for s in seqs]
        return StepOutput(seqs, sample(logits, requests))

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
