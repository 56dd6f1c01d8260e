"""One rank's part of a step: its pipeline stage run over each micro-batch in turn.

With pipeline parallelism a step's batch is cut into micro-batches of whole sequences, one per
stage, so that stages work at the same time: while stage 1 runs micro-batch 0, stage 0 already
runs micro-batch 1 (GPipe's schedule, within one step: a fill and a drain bubble at its ends).
Activations go to the next stage with asynchronous sends; the last stage sends the logits back
to the driver, which samples. Every rank learns the step's inputs from the driver, so each
knows the shape of everything it receives and no sizes travel with the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.distributed import PPGroup
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, StepInputs
from engine.scheduler import ScheduledBatch


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


def split_micro_batches(batch: ScheduledBatch, n: int) -> list[ScheduledBatch]:
    """At most `n` non-empty micro-batches of whole sequences, as even in tokens as can be."""
    if n == 1:
        return [batch]
    parts = [ScheduledBatch() for _ in range(min(n, len(batch)))]
    # Largest first, each to the lightest part so far: a long prefill chunk gets a part to
    # itself while the decodes share the others.
    entries = sorted(zip(batch.seqs, batch.num_scheduled_tokens, strict=True), key=lambda e: -e[1])
    for seq, num_tokens in entries:
        part = min(parts, key=lambda p: p.num_tokens)
        part.seqs.append(seq)
        part.num_scheduled_tokens.append(num_tokens)
    return parts


@dataclass(slots=True)
class PipelineStage:
    runner: ModelRunner
    pp: PPGroup

    @property
    def is_driver(self) -> bool:
        return self.pp.is_first and self.pp.tp_rank == 0

    def run(self, micro_batches: list[StepInputs]) -> torch.Tensor | None:
        """Run every micro-batch through this rank's layers, in order. Returns the fp32 logits
        of the sampled rows of all of them, in order, where this rank has them (the driver and
        the last stage); None elsewhere."""
        sends = []
        logits = []
        for tag, inputs in enumerate(micro_batches):
            hidden = None
            if not self.pp.is_first:
                hidden = self.pp.recv_prev(self.runner.hidden_buffer(inputs), tag)
            out = self.runner.run(inputs, hidden)
            if not self.pp.is_last:
                sends.append(self.pp.send_next(out, tag))
                continue
            logits.append(out)
            if self.pp.sends_logits and out.numel():
                sends.append(self.pp.send_logits(out, tag))
        if self.is_driver and not self.pp.is_last:
            logits = [self._recv_logits(inputs, tag) for tag, inputs in enumerate(micro_batches)]
        for work in sends:
            work.wait()
        return torch.cat(logits) if logits else None

    def _recv_logits(self, inputs: StepInputs, tag: int) -> torch.Tensor:
        shape = (inputs.logits_rows.numel(), self.runner.config.vocab_size)
        buffer = torch.empty(shape, dtype=torch.float32, device=self.runner.device)
        return self.pp.recv_logits(buffer, tag) if buffer.numel() else buffer
