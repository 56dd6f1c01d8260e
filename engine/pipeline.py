"""One rank's part of a batch: its pipeline stage, between the stage before and the one after.

With pipeline parallelism the engine keeps up to `pipeline_parallel_size` batches of disjoint
sequences in flight: while stage 1 runs batch A, stage 0 already runs batch B, and once A's
logits are back its sequences can go again in batch C. Every stage stays busy, each reads its
weights once per batch, and no step waits for a fill or drain bubble. Activations go to the
next stage with asynchronous sends; the last stage sends the logits back to the driver, which
samples. Every rank learns each batch's inputs from the driver, so each knows the shape of
everything it receives and no sizes travel with the tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.distributed import PPGroup
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, StepInputs


def stage_layers(config: ModelConfig, pp_size: int, stage: int) -> range:
    """The decoder layers stage `stage` holds: contiguous runs of at least one layer, balanced
    by the weights each stage reads per step, which set a decode step's time. The last stage
    also reads the LM head (for SmolLM2 as much as 8 layers), so it gets fewer layers."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = c.hidden_size * (2 * q_dim + 2 * kv_dim + 3 * c.intermediate_size)
    head_in_layers = c.vocab_size * c.hidden_size / layer
    share = (c.num_layers + head_in_layers) / pp_size
    last = min(max(1, round(share - head_in_layers)), c.num_layers - (pp_size - 1))
    if stage == pp_size - 1:
        return range(c.num_layers - last, c.num_layers)
    rest, others = c.num_layers - last, pp_size - 1
    return range(rest * stage // others, rest * (stage + 1) // others)


@dataclass(frozen=True, slots=True)
class StageWork:
    """One batch as the driver sends it to every worker; `tag` matches its sends and receives."""

    tag: int
    inputs: StepInputs


@dataclass(slots=True)
class PipelineStage:
    runner: ModelRunner
    pp: PPGroup
    # Sends still travelling, with their tensors: a send must not be waited on at once (the
    # next stage takes it when it is done with the batch before), nor its tensor freed.
    sending: deque[tuple[dist.Work, torch.Tensor]] = field(default_factory=deque)

    def forward(self, work: StageWork) -> torch.Tensor | None:
        """Run this rank's layers over one batch: receive from the stage before, run, send on.
        Returns the logits (fp32, sampled rows) where this rank computed them: the last stage."""
        hidden = None
        if not self.pp.is_first:
            hidden = self.pp.recv_prev(self.runner.hidden_buffer(work.inputs), work.tag)
        out = self.runner.run(work.inputs, hidden)
        if not self.pp.is_last:
            self.sending.append((self.pp.send_next(out, work.tag), out))
        elif self.pp.sends_logits and out.numel():
            self.sending.append((self.pp.send_logits(out, work.tag), out))
        # Only this many can be unreceived: the batches the later stages still have to take.
        while len(self.sending) > self.pp.size:
            self.sending.popleft()[0].wait()
        return out if self.pp.is_last else None

    def receive_logits(self, work: StageWork) -> torch.Tensor:
        """On the driver of a pipeline: the logits of `work` from the last stage."""
        shape = (work.inputs.logits_rows.numel(), self.runner.config.vocab_size)
        buffer = torch.empty(shape, dtype=torch.float32, device=self.runner.device)
        return self.pp.recv_logits(buffer, work.tag) if buffer.numel() else buffer
