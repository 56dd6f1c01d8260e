"""Process groups for tensor and pipeline parallelism: which backend, how ranks are laid out,
the collectives the model layers use, and the sends that carry activations between stages.

Global rank = stage * tp_size + tp_rank: a stage's TP ranks are neighbours, and rank 0 (stage 0,
TP rank 0) is the driver. With one rank nothing here touches torch.distributed, so
single-process runs need no set-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes: chosen here and nowhere else."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True, slots=True)
class PPGroup:
    """This process's place in the pipeline: its stage, and the ranks it passes tensors to.

    Each TP rank of a stage sends its (replicated) activations to the same TP rank of the next
    stage; TP rank 0 of the last stage sends the logits back to the driver, which samples."""

    stage: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def sends_logits(self) -> bool:
        return self.size > 1 and self.is_last and self.tp_rank == 0

    def send_next(self, x: torch.Tensor, tag: int) -> dist.Work:
        return self._isend(x, self._rank_of(self.stage + 1), tag)

    def recv_prev(self, x: torch.Tensor, tag: int) -> torch.Tensor:
        """Fill `x` (allocated with the shape both stages know) from the previous stage."""
        return self._recv(x, self._rank_of(self.stage - 1), tag)

    def send_logits(self, logits: torch.Tensor, tag: int) -> dist.Work:
        return self._isend(logits, 0, tag)

    def recv_logits(self, x: torch.Tensor, tag: int) -> torch.Tensor:
        return self._recv(x, self._rank_of(self.size - 1), tag)

    def _rank_of(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def _isend(self, x: torch.Tensor, dst: int, tag: int) -> dist.Work:
        # Asynchronous: a stage goes on with its next batch while this one travels.
        work = dist.isend(x.contiguous(), dst, group=self.group, tag=tag)
        assert work is not None, "this rank belongs to the group"
        return work

    def _recv(self, x: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        dist.recv(x, src, group=self.group, tag=tag)
        return x


def init_groups(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    device: torch.device,
    step_timeout_s: float,
    rendezvous_timeout_s: float,
) -> tuple[TPGroup, PPGroup]:
    """Join the world and this rank's groups, waiting up to `rendezvous_timeout_s` for the
    other ranks to come; once running, a collective or a receive that waits longer than
    `step_timeout_s` means a rank died or hung."""
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=tp_size * pp_size,
        timeout=timedelta(seconds=rendezvous_timeout_s),
    )
    timeout = timedelta(seconds=step_timeout_s)
    stage, tp_rank = divmod(rank, tp_size)
    tp = TPGroup()
    if tp_size > 1:
        # Every rank creates every group, in the same order, as torch.distributed requires.
        for s in range(pp_size):
            group = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timeout)
            if s == stage:
                tp = TPGroup(tp_rank, tp_size, group)
    pp = PPGroup(tp_rank=tp_rank, tp_size=tp_size)
    if pp_size > 1:
        world = dist.new_group(list(range(tp_size * pp_size)), timeout=timeout)
        pp = PPGroup(stage, pp_size, tp_rank, tp_size, world)
    return tp, pp


def valid_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = 16) -> list[int]:
    """Sizes that split the query heads evenly and the KV heads evenly or by replication."""
    return [
        n
        for n in range(1, limit + 1)
        if num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
    ]
