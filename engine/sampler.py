"""Turns each sequence's logits into its next token, batched across the step.

Random choices use the exponential-race form of sampling (argmax of p / E, E ~ Exp(1)): the
same distribution as torch.multinomial, but the noise can come from a per-request generator
seeded by (seed, position), so a seeded request draws the same tokens whatever it is batched
with and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class SamplingRequest:
    """What the sampler needs to know of one sequence."""

    params: SamplingParams
    output_index: int  # index of the token being sampled among the request's outputs


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
    """logits (N, vocab) fp32, one row per request -> one token (and logprobs) per request."""
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        token_ids[rows] = _sample_random(logits[rows], [requests[i] for i in random_rows])
    chosen = token_ids.tolist()
    return SamplerOutput(chosen, _logprobs(logits, requests, chosen))


def _sample_random(logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    temperatures = torch.tensor(
        [r.params.temperature for r in requests], device=logits.device, dtype=logits.dtype
    )
    logits = logits / temperatures.unsqueeze(1)
    top_ks = [r.params.top_k for r in requests]
    if any(top_ks):
        logits = _apply_top_k(logits, top_ks)
    top_ps = [r.params.top_p for r in requests]
    if any(p < 1.0 for p in top_ps):
        logits = _apply_top_p(logits, top_ps)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for row, request in enumerate(requests):
        seed = request.params.seed
        if seed is None:
            noise[row].exponential_()
        else:
            generator = torch.Generator(device=logits.device)
            generator.manual_seed((seed * _SEED_MIX + request.output_index) & _SEED_MASK)
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    ks = [min(k, vocab_size) if k > 0 else vocab_size for k in top_ks]
    top_values = logits.topk(max(ks), dim=-1).values
    kth = top_values.gather(1, torch.tensor(ks, device=logits.device).unsqueeze(1) - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    p = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    # Drop a token when the tokens ranked above it already reach p; the top one always stays.
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _logprobs(
    logits: torch.Tensor, requests: list[SamplingRequest], chosen: list[int]
) -> list[TokenLogprobs | None]:
    result: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return result
    logprobs = logits[torch.tensor(rows, device=logits.device)].log_softmax(dim=-1)
    max_top = max(requests[i].params.logprobs or 0 for i in rows)
    top = logprobs.topk(max_top, dim=-1) if max_top else None
    for j, row in enumerate(rows):
        num_top = requests[row].params.logprobs or 0
        top_pairs: list[tuple[int, float]] = []
        if top is not None and num_top:
            ids = top.indices[j, :num_top].tolist()
            values = top.values[j, :num_top].tolist()
            top_pairs = list(zip(ids, values, strict=True))
        result[row] = TokenLogprobs(chosen[row], float(logprobs[j, chosen[row]]), top_pairs)
    return result
