"""A request's bookkeeping inside the engine: its tokens, its KV blocks, its progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprobs:
    """The chosen token's log-probability and, if asked for, the top candidates'."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Sequence:
    """One request. The scheduler moves `num_computed_tokens` up to `num_tokens`: prefill and
    decode are the same thing seen at different distances, so chunked prefill needs no mode."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    # Mixed into the hash of the first block: requests share cached blocks only with requests
    # of the same salt (vLLM's `cache_salt`; one per tenant closes the prefix cache's timing
    # side channel between tenants).
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens whose KV came from the prefix cache when the request was (last) admitted.
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Hash chain of this sequence's full blocks, in order; grows as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Scheduled in a batch whose result has not come back yet (pipeline parallelism keeps
    # several batches in flight); such a sequence is neither scheduled again nor preempted.
    in_flight: bool = False
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # Where a constrained request is in its grammar (set once the grammar is compiled).
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
