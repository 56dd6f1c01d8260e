"""Tensor-parallel process groups: which backend, and the collectives the model layers use.

With one rank nothing here touches torch.distributed, so single-process runs need no set-up.
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


def init_tp_group(
    rank: int, size: int, init_method: str, device: torch.device, step_timeout_s: float
) -> TPGroup:
    """Join the group. Start-up may wait for every rank to load its weights; once running, a
    collective that waits longer than `step_timeout_s` means a rank died or hung."""
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timedelta(minutes=10),
    )
    group = dist.new_group(list(range(size)), timeout=timedelta(seconds=step_timeout_s))
    return TPGroup(rank, size, group)


def valid_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = 16) -> list[int]:
    """Sizes that split the query heads evenly and the KV heads evenly or by replication."""
    return [
        n
        for n in range(1, limit + 1)
        if num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
    ]
