"""Per-request sampling settings, validated once at the boundary."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError, RequestRejected
from engine.grammar_spec import GrammarSpec

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries the whole text so far
    DELTA = "delta"  # every output carries only what is new: for streaming
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop; the names follow vLLM's.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 disable those filters. A seed makes the
    request's samples reproducible whatever else runs beside it. logprobs None returns none,
    0 the chosen token's only, N also the top N (of the logits after the penalties, bias and
    grammar below).

    presence_penalty and frequency_penalty (OpenAI's, in [-2, 2]) subtract from a token's logit
    once if it is in the output so far, and once per time it is; repetition_penalty (vLLM's,
    > 0, 1 is off) divides a positive logit of a token seen in the prompt or output, multiplies
    a negative one. logit_bias adds to a token id's logit. Until min_tokens are out, the end of
    sequence and stop_token_ids cannot be sampled. A grammar constrains every token to keep the
    output a prefix of its language; its end finishes the request ("stop").
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids")
        self._validate_controls()

    def _validate_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise RequestRejected(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise RequestRejected(
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            )
        if any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in self.logit_bias.values()):
            raise RequestRejected("logit_bias", "logit_bias values must be in [-100, 100]")
        if any(t < 0 for t in self.logit_bias):
            raise RequestRejected("logit_bias", "logit_bias keys must be non-negative token ids")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise RequestRejected("min_tokens", "min_tokens must be in [0, max_tokens]")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
