"""What each policy's run produced: one row per request, and the numbers the table shows.

`failed`: requests that ended in an error for the client (every attempt failed, no region could take
them, or their stream broke and could not be continued). `retried`: requests that needed more than
one attempt to get a first byte, from the first region or, after a break, from the next. `resumed`:
requests whose stream broke and was continued in another region, whatever their end; `resume_p99_s`:
over those whose continuation sent a byte, the p99 of the longest wait from a break reaching the
gateway (a reset's arrival; for a hung node, the start of its silence there) to the continuation's
first byte there (what the client sees as a gap in its stream, less the one-way delay). `lost`:
requests that never ended when the world ran dry (an accounting check: it must be 0). `goodput`: the
share of all requests whose first token reached the client within `GOODPUT_TTFT_S`. With an edge
tier: `edge_share`, the share of all requests the edge answered, and `auto_ttft_p99_s`, the p99 TTFT
of the requests sent as `auto`. Per model asked for (`models`): how many asked for it, the p99
TTFT of those answered (by it or by a fallback), how many failed, and how many a fallback
answered. `cache_share`: the share of the answered requests' prompt tokens found in their node's
prefix cache (of the attempt that answered). `floor_p99_s`: the p99, over the requests answered,
of each one's TTFT floor (simulator/bound.py), which no policy can beat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

import numpy as np
import numpy.typing as npt

from simulator.workload import Request

GOODPUT_TTFT_S: Final = 1.0
NOT_ENDED: Final = -1
# Which tier answered a request (`auto` requests only, in a world with an edge tier).
TIER_NONE: Final = -1
TIER_REGION: Final = 0
TIER_EDGE: Final = 1


class Outcome(IntEnum):
    OK = 0
    FAILED = 1  # every attempt failed
    NO_CAPACITY = 2  # no region could take it
    CUT = 3  # the stream broke after its first byte and was not continued to its end


@dataclass(frozen=True, slots=True)
class ModelStats:
    """The requests that asked for one model."""

    requests: int
    ttft_p99_s: float  # of those answered, by the model or a fallback
    failed: int
    by_fallback: int  # answered by another model

    def to_json(self) -> dict[str, float | int | None]:
        return {
            "requests": self.requests,
            "ttft_p99_s": _rounded(self.ttft_p99_s),
            "failed": self.failed,
            "by_fallback": self.by_fallback,
        }


@dataclass(frozen=True, slots=True)
class PolicyStats:
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    e2e_p99_s: float
    goodput: float
    failed: int
    retried: int
    lost: int
    resumed: int = 0
    resume_p99_s: float = float("nan")
    edge_share: float = 0.0
    auto_ttft_p99_s: float = float("nan")
    models: dict[str, ModelStats] = field(default_factory=dict)  # by the model asked for
    # The p99 of the answered requests' floors (simulator/bound.py): at most `ttft_p99_s`.
    floor_p99_s: float = float("nan")
    cache_share: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "ttft_p50_s": round(self.ttft_p50_s, 4),
            "ttft_p95_s": round(self.ttft_p95_s, 4),
            "ttft_p99_s": round(self.ttft_p99_s, 4),
            "e2e_p99_s": round(self.e2e_p99_s, 4),
            "goodput": round(self.goodput, 4),
            "failed": self.failed,
            "retried": self.retried,
            "lost": self.lost,
            "resumed": self.resumed,
            "resume_p99_s": _rounded(self.resume_p99_s),
            "edge_share": round(self.edge_share, 4),
            "auto_ttft_p99_s": _rounded(self.auto_ttft_p99_s),
            "models": {name: stats.to_json() for name, stats in self.models.items()},
            "floor_p99_s": _rounded(self.floor_p99_s),
            "cache_share": round(self.cache_share, 4),
        }


def _rounded(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds, 4)


def _pct(values: npt.NDArray[np.float64], q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


class Recorder:
    def __init__(self, num_requests: int, regions: list[str], models: list[str]) -> None:
        self.regions = regions
        self.models = models
        self._region_index = {name: i for i, name in enumerate(regions)}
        self._model_index = {name: i for i, name in enumerate(models)}
        self.outcome = np.full(num_requests, NOT_ENDED, dtype=np.int8)
        self.region = np.full(num_requests, -1, dtype=np.int16)
        self.num_attempts = np.zeros(num_requests, dtype=np.int16)
        self.num_resumes = np.zeros(num_requests, dtype=np.int16)
        self.arrival_s = np.zeros(num_requests)
        self.ttft_s = np.full(num_requests, np.nan)
        self.e2e_s = np.full(num_requests, np.nan)
        self.resume_s = np.full(num_requests, np.nan)
        self.tier = np.full(num_requests, TIER_NONE, dtype=np.int8)
        self.asked = np.full(num_requests, -1, dtype=np.int8)  # the model asked for
        self.answered = np.full(num_requests, -1, dtype=np.int8)  # the model that answered
        self.prompt_tokens = np.zeros(num_requests, dtype=np.int64)
        self.cached_tokens = np.zeros(num_requests, dtype=np.int64)
        self.num_ended = 0

    def record(
        self,
        request: Request,
        outcome: Outcome,
        region: str,
        num_attempts: int,
        num_resumes: int,
        ttft_s: float,
        e2e_s: float,
        resume_s: float,
        tier: int = TIER_NONE,
        answered_by: str | None = None,
    ) -> None:
        """`answered_by`: the model that answered (None: it failed)."""
        i = request.request_id
        assert self.outcome[i] == NOT_ENDED, f"request {i} ended twice"
        self.num_ended += 1
        self.outcome[i] = outcome
        self.region[i] = self._region_index.get(region, -1)
        self.num_attempts[i] = num_attempts
        self.num_resumes[i] = num_resumes
        self.arrival_s[i] = request.arrival_s
        self.ttft_s[i] = ttft_s
        self.e2e_s[i] = e2e_s
        self.resume_s[i] = resume_s
        self.tier[i] = tier
        self.asked[i] = self._model_index[request.model]
        if answered_by is not None:
            self.answered[i] = self._model_index[answered_by]

    def note_prefill(self, request_id: int, prompt_tokens: int, cached_tokens: int) -> None:
        """An attempt's first token: its prompt, and how much of it the node had cached."""
        self.prompt_tokens[request_id] = prompt_tokens
        self.cached_tokens[request_id] = cached_tokens

    def ok_ttfts_s(self) -> npt.NDArray[np.float64]:
        return self.ttft_s[self.outcome == Outcome.OK]

    def stats(self, floors_s: npt.NDArray[np.float64] | None = None) -> PolicyStats:
        """`floors_s`: each request's TTFT floor (simulator/bound.py), if worked out."""
        ok = self.outcome == Outcome.OK
        ttft = self.ttft_s[ok]
        e2e = self.e2e_s[ok]

        return PolicyStats(
            ttft_p50_s=_pct(ttft, 50),
            ttft_p95_s=_pct(ttft, 95),
            ttft_p99_s=_pct(ttft, 99),
            e2e_p99_s=_pct(e2e, 99),
            goodput=float(np.count_nonzero(ttft <= GOODPUT_TTFT_S)) / len(self.outcome),
            failed=int(np.count_nonzero((self.outcome != Outcome.OK) & (self.outcome >= 0))),
            retried=int(np.count_nonzero(self.num_attempts > 1 + self.num_resumes)),
            lost=int(np.count_nonzero(self.outcome == NOT_ENDED)),
            resumed=int(np.count_nonzero(self.num_resumes)),
            resume_p99_s=_pct(self.resume_s[~np.isnan(self.resume_s)], 99),
            edge_share=float(np.count_nonzero(ok & (self.tier == TIER_EDGE))) / len(self.outcome),
            auto_ttft_p99_s=_pct(self.ttft_s[ok & (self.tier != TIER_NONE)], 99),
            models={model: self.model_stats(model) for model in self.models},
            floor_p99_s=float("nan") if floors_s is None else _pct(floors_s[ok], 99),
            cache_share=float(self.cached_tokens[ok].sum())
            / max(1, int(self.prompt_tokens[ok].sum())),
        )

    def model_stats(self, model: str) -> ModelStats:
        index = self._model_index[model]
        asked = self.asked == index
        ok = asked & (self.outcome == Outcome.OK)
        failed = asked & (self.outcome != Outcome.OK) & (self.outcome != NOT_ENDED)
        return ModelStats(
            requests=int(np.count_nonzero(asked)),
            ttft_p99_s=_pct(self.ttft_s[ok], 99),
            failed=int(np.count_nonzero(failed)),
            by_fallback=int(np.count_nonzero(ok & (self.answered != index))),
        )
