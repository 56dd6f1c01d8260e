"""Which region a request tries next: the attempt sequence as a pure state machine.

No I/O and no clock of its own (the caller passes `now_s`), so that the proxy and the simulator
drive the same decisions. A request first opens: regions in the plan's order, at most `max_attempts`
of them, until one answers. Once its stream is committed and then breaks, it may resume (at most
`max_resumes` times): each resume opens again among regions not tried yet, at most `max_attempts` of
them, in the order of a plan made at the break (the router's view then: the broken region's breaker,
the other streams already moved) or, without one, the first plan's. Every attempt stays within the
deadline, and no region is tried twice for one request (a region that failed it once is the last
place to ask), but for a region whose picker sent the first attempt back (`deflected`): it can take
the request, so it is asked again last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway.routing import Candidate
from wire.region_summary import RegionSummary

GiveUpReason = Literal["deadline", "exhausted", "max_resumes"]


@dataclass(frozen=True, slots=True)
class AttemptLimits:
    max_attempts: int  # regions one opening may try (the first try and its failovers)
    max_resumes: int  # continuations after a committed stream broke


@dataclass(frozen=True, slots=True)
class ConnectTimeout:
    """How long a connect to a region may take. A TCP handshake is one round trip, so a region
    gets `rtts` of its expected RTT, within [min_s, max_s]: a dark region nearby costs a fraction
    of a second instead of the ceiling. A connect whose SYN was lost (Linux retransmits it after
    1 s) may then give up early too, and goes to the next region as from a dark one."""

    rtts: float
    min_s: float
    max_s: float

    def of(self, rtt_ms: float) -> float:
        return min(self.max_s, max(self.min_s, self.rtts * rtt_ms / 1000.0))


@dataclass(frozen=True, slots=True)
class Try:
    candidate: Candidate
    is_resume: bool  # the continuation of a stream that broke elsewhere
    is_first: bool  # the request's first attempt: not sent here because another region failed
    # The last place to ask: no region left in this opening, no other model after it.
    is_last: bool
    # What the plan's next-best region costs, told this region (a first attempt only: any later
    # one is sent where the plan had no better choice left; wire/deflection.py).
    alternative_s: float | None = None

    @property
    def awaited_tokens(self) -> int:
        """The prompt the attempt brings the region to prefill (less what the plan took as
        cached there): what this gateway counts as queue there until the first byte
        (gateway/routing.py)."""
        return self.candidate.prompt_tokens - self.candidate.cached_tokens


def waits_past_timeout(step: Try, summary: RegionSummary | None) -> bool:
    """Whether an attempt still without its first byte at the first-byte timeout is waited on
    (up to the request's deadline). The timer is there to fail over: the last region an opening
    may try is waited on while the summary this gateway holds shows it a healthy node, as a slow
    region that answers beats an error; one whose nodes stopped beating (hung, or gone with the
    connection open) shows none and is given up on as before."""
    return step.is_last and summary is not None and summary.healthy_nodes > 0


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: GiveUpReason


@dataclass(slots=True)
class AttemptSequence:
    candidates: list[Candidate]  # the plan: the choice first, then failover order
    limits: AttemptLimits
    deadline_s: float
    # No other model is tried after these regions (the request's last fallback): its last
    # region is the last place to ask at all.
    is_last_resort: bool = False
    alternative_s: float | None = None  # the plan's (RoutePlan.alternative_s)
    num_tried: int = 0  # candidates handed out so far
    num_resumes: int = 0
    _num_left_in_opening: int = 0

    def __post_init__(self) -> None:
        self._num_left_in_opening = self.limits.max_attempts

    def next(self, now_s: float) -> Try | GiveUp:
        """The region to try now (the previous attempt, if any, failed before committing)."""
        if now_s >= self.deadline_s:
            return GiveUp("deadline")
        if self._num_left_in_opening <= 0 or self.num_tried >= len(self.candidates):
            return GiveUp("exhausted")
        candidate = self.candidates[self.num_tried]
        self.num_tried += 1
        self._num_left_in_opening -= 1
        is_last = self.is_last_resort and (
            self._num_left_in_opening == 0 or self.num_tried == len(self.candidates)
        )
        is_first = self.num_tried == 1
        alternative_s = self.alternative_s if is_first else None
        return Try(candidate, self.num_resumes > 0, is_first, is_last, alternative_s)

    def deflected(self) -> None:
        """The attempt just handed out was sent back by its region's picker (wire/deflection.py):
        it counts against no limit, and the region, which can take the request, becomes the
        last place to ask (asked then without an alternative, so it does not send it back)."""
        self._num_left_in_opening += 1
        self.candidates = [*self.candidates, self.candidates[self.num_tried - 1]]

    def resume(
        self, now_s: float, replan: Callable[[list[str]], list[Candidate]] | None = None
    ) -> GiveUp | None:
        """The committed stream broke: None if it may continue (then call `next`), else why
        not. `replan(regions tried)`, the router's plan now among the others, orders them; it
        is asked only for a resume that may happen."""
        if self.num_resumes >= self.limits.max_resumes:
            return GiveUp("max_resumes")
        if now_s >= self.deadline_s:
            return GiveUp("deadline")
        if replan is not None:
            tried = self.candidates[: self.num_tried]
            regions = [c.region for c in tried]
            self.candidates = [*tried, *(c for c in replan(regions) if c.region not in regions)]
        if self.num_tried >= len(self.candidates):
            return GiveUp("exhausted")
        self.num_resumes += 1
        self._num_left_in_opening = self.limits.max_attempts
        return None
