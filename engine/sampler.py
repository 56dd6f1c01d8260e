"""Turns each sequence's logits into its next token, batched across the step.

Random choices use the exponential-race form of sampling (argmax of p / E, E ~ Exp(1)): the
same distribution as torch.multinomial, but the noise can come from a per-request generator
seeded by (seed, position), so a seeded request draws the same tokens whatever it is batched
with and after a preemption.

Before choosing, `process_logits` applies the requests' logit controls, each as one batched op
over the rows that ask for it (the other rows are not touched): penalties, logit_bias,
min_tokens, then the grammars' masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.grammar import GrammarMatcher
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class SamplingRequest:
    """What the sampler needs to know of one sequence."""

    params: SamplingParams
    output_index: int  # index of the token being sampled among the request's outputs
    # The sequence's tokens so far (prompt, then output: read for penalties, not copied).
    token_ids: list[int] | None = None
    grammar: GrammarMatcher | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(
    logits: torch.Tensor,
    requests: list[SamplingRequest],
    eos_token_ids: frozenset[int] = frozenset(),
) -> SamplerOutput:
    """logits (N, vocab) fp32, one row per request -> one token (and logprobs) per request.
    `eos_token_ids`: what min_tokens holds back besides the request's stop_token_ids."""
    logits = process_logits(logits, requests, eos_token_ids)
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        token_ids[rows] = _sample_random(logits[rows], [requests[i] for i in random_rows])
    chosen = token_ids.tolist()
    return SamplerOutput(chosen, _logprobs(logits, requests, chosen))


@torch.inference_mode()  # the model's logits are inference tensors: rows are changed in place
def process_logits(
    logits: torch.Tensor, requests: list[SamplingRequest], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """The logits with each row's penalties, bias, min_tokens and grammar applied (in place)."""
    penalized = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if penalized:
        logits[penalized] = _apply_penalties(logits[penalized], [requests[i] for i in penalized])
    cells: list[tuple[int, int, float]] = []  # (row, token id, added to the logit)
    for i, r in enumerate(requests):
        params = r.params
        cells += [(i, t, bias) for t, bias in params.logit_bias.items()]
        if r.output_index < params.min_tokens:
            held = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
            cells += [(i, t, float("-inf")) for t in held]
    if cells:
        rows, cols, values = zip(*cells, strict=True)
        index = (_index(rows, logits), _index(cols, logits))
        logits.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    if constrained:
        bitmask = torch.empty((len(constrained), -(-logits.shape[1] // 32)), dtype=torch.int32)
        for j, i in enumerate(constrained):
            grammar = requests[i].grammar
            assert grammar is not None
            grammar.fill_bitmask(bitmask, j)
        rows_index = _index(constrained, logits)
        logits[rows_index] = _apply_bitmask(logits[rows_index], bitmask.to(logits.device))
    return logits


def _index(values: tuple[int, ...] | list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _apply_penalties(logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output, presence and frequency over the
    output only."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    all_counts = torch.zeros((num_rows, vocab_size), device=device)
    output_counts = torch.zeros((num_rows, vocab_size), device=device)
    for row, r in enumerate(requests):
        token_ids = r.token_ids or []
        num_prompt = len(token_ids) - r.output_index
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        ones = torch.ones(len(token_ids), device=device)
        all_counts[row].index_add_(0, ids, ones)
        output_counts[row].index_add_(0, ids[num_prompt:], ones[num_prompt:])
    params = [r.params for r in requests]
    repetition = _column([p.repetition_penalty for p in params], logits)
    seen = all_counts > 0
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, scaled, logits)
    logits = logits - _column([p.frequency_penalty for p in params], logits) * output_counts
    return logits - _column([p.presence_penalty for p in params], logits) * (output_counts > 0)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, device=like.device, dtype=like.dtype).unsqueeze(1)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where a row's bit is 0; bit i of int32 word w stands for token 32 w + i."""
    # Read as little-endian bytes, bit i of byte b is token 8 b + i: one AND over bytes, where
    # shifting the int32 words by 0..31 costs four times the memory traffic.
    bits = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=logits.device)
    forbidden = (bitmask.view(torch.uint8).unsqueeze(-1) & bits).eq(0)
    forbidden = forbidden.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]]
    return logits.masked_fill_(forbidden, float("-inf"))


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
