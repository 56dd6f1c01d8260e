"""The attempt sequence: which region a request tries next, opening and resuming (pure)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.attempts import AttemptLimits, AttemptSequence, ConnectTimeout, GiveUp, Try
from gateway.routing import Candidate


def plan(*regions: str) -> list[Candidate]:
    return [
        Candidate(r, f"http://{r}", 0.01 * i, 0.01 * i, 10.0, 100) for i, r in enumerate(regions)
    ]


def names(sequence: AttemptSequence, now_s: float = 0.0) -> list[str]:
    tried = []
    while isinstance(step := sequence.next(now_s), Try):
        tried.append(step.candidate.region)
    return tried


def test_opening_tries_the_plan_in_order_up_to_max_attempts() -> None:
    sequence = AttemptSequence(plan("a", "b", "c", "d"), AttemptLimits(3, 1), deadline_s=10.0)
    assert names(sequence) == ["a", "b", "c"]
    assert sequence.next(0.0) == GiveUp("exhausted")


def test_the_last_place_to_ask_is_the_last_region_of_the_last_model() -> None:
    def lasts(sequence: AttemptSequence) -> list[bool]:
        steps = []
        while isinstance(step := sequence.next(0.0), Try):
            steps.append(step.is_last)
        return steps

    def last_resort(regions: tuple[str, ...], max_attempts: int) -> AttemptSequence:
        return AttemptSequence(plan(*regions), AttemptLimits(max_attempts, 1), 10.0, True)

    assert lasts(last_resort(("a", "b"), 3)) == [False, True]  # the plan ends
    assert lasts(last_resort(("a", "b", "c"), 2)) == [False, True]  # the attempts do
    assert lasts(last_resort(("a",), 3)) == [True]
    resumed = last_resort(("a", "b", "c"), 1)
    assert lasts(resumed) == [True]
    assert resumed.resume(1.0) is None
    assert lasts(resumed) == [True]  # a resume is an opening of its own
    # A model with fallbacks after it: its regions are never the last place.
    assert lasts(AttemptSequence(plan("a", "b"), AttemptLimits(3, 1), 10.0)) == [False, False]


def test_each_attempt_brings_its_region_the_prompt_not_taken_as_cached_there() -> None:
    cached = Candidate("b", "http://b", 0.01, 0.01, 10.0, 100, cached_tokens=60)
    sequence = AttemptSequence([*plan("a"), cached], AttemptLimits(3, 1), deadline_s=10.0)
    first, failover = sequence.next(0.0), sequence.next(1.0)
    assert isinstance(first, Try) and isinstance(failover, Try)
    assert (first.is_first, first.awaited_tokens) == (True, 100)
    assert (failover.is_first, failover.awaited_tokens) == (False, 40)


def test_only_the_first_attempt_carries_the_plans_alternative() -> None:
    sequence = AttemptSequence(plan("a", "b", "c"), AttemptLimits(3, 1), 10.0, alternative_s=0.2)
    steps = [sequence.next(0.0) for _ in range(3)]
    assert [s.alternative_s for s in steps if isinstance(s, Try)] == [0.2, None, None]
    # Nor does a continuation.
    resumed = AttemptSequence(plan("a", "b"), AttemptLimits(1, 1), 10.0, alternative_s=0.2)
    resumed.next(0.0)
    assert resumed.resume(1.0) is None
    step = resumed.next(1.0)
    assert isinstance(step, Try) and step.is_resume and step.alternative_s is None


def test_a_region_that_sent_the_first_attempt_back_is_asked_again_last_at_no_cost() -> None:
    sequence = AttemptSequence(plan("a", "b", "c"), AttemptLimits(2, 1), 10.0, True, 0.2)
    first = sequence.next(0.0)
    assert isinstance(first, Try) and first.alternative_s == 0.2
    sequence.deflected()
    steps = []
    while isinstance(step := sequence.next(0.0), Try):
        steps.append((step.candidate.region, step.alternative_s, step.is_last))
    # Two attempts after the one sent back, as if it had not been made; then no more (the
    # limit of two), so "a" comes last only where the plan has room for it.
    assert steps == [("b", None, False), ("c", None, True)]
    again = AttemptSequence(plan("a", "b"), AttemptLimits(3, 1), 10.0, True, 0.2)
    again.next(0.0)
    again.deflected()
    assert names(again) == ["b", "a"]


def test_a_resume_goes_on_with_regions_not_tried_yet_and_is_marked() -> None:
    sequence = AttemptSequence(plan("a", "b", "c"), AttemptLimits(3, 2), deadline_s=10.0)
    first = sequence.next(0.0)
    assert first == Try(plan("a")[0], is_resume=False, is_first=True, is_last=False)
    assert sequence.resume(1.0) is None
    step = sequence.next(1.0)
    assert isinstance(step, Try) and step.candidate.region == "b" and step.is_resume
    assert step.awaited_tokens == step.candidate.prompt_tokens  # a broken stream's work
    assert sequence.resume(2.0) is None
    assert names(sequence, 2.0) == ["c"]


def test_a_resume_follows_the_plan_made_at_the_break_without_the_regions_tried() -> None:
    sequence = AttemptSequence(plan("a", "b", "c", "d"), AttemptLimits(3, 2), deadline_s=10.0)
    sequence.next(0.0)
    asked: list[list[str]] = []

    def replan(*regions: str) -> Callable[[list[str]], list[Candidate]]:
        def plan_now(tried: list[str]) -> list[Candidate]:
            asked.append(tried)
            return plan(*regions)

        return plan_now

    assert sequence.resume(1.0, replan("d", "a", "c")) is None
    assert names(sequence, 1.0) == ["d", "c"]  # "a" broke once already; "b" is not in it now
    assert sequence.resume(2.0, replan("b", "c", "a")) is None
    assert names(sequence, 2.0) == ["b"]
    assert asked == [["a"], ["a", "d", "c"]]  # the router is told what not to plan
    assert sequence.resume(3.0, replan("e")) == GiveUp("max_resumes")
    assert len(asked) == 2  # no plan for a resume that cannot happen
    empty = AttemptSequence(plan("a", "b"), AttemptLimits(3, 2), deadline_s=10.0)
    empty.next(0.0)
    assert empty.resume(1.0, lambda tried: []) == GiveUp("exhausted")


def test_resumes_are_refused_past_the_budget_the_deadline_or_the_last_region() -> None:
    limits = AttemptLimits(max_attempts=3, max_resumes=1)
    sequence = AttemptSequence(plan("a", "b", "c"), limits, deadline_s=10.0)
    sequence.next(0.0)
    assert sequence.resume(1.0) is None
    sequence.next(1.0)
    assert sequence.resume(2.0) == GiveUp("max_resumes")

    late = AttemptSequence(plan("a", "b"), limits, deadline_s=10.0)
    late.next(0.0)
    assert late.resume(10.0) == GiveUp("deadline")

    alone = AttemptSequence(plan("a"), limits, deadline_s=10.0)
    alone.next(0.0)
    assert alone.resume(1.0) == GiveUp("exhausted")


def test_no_attempt_starts_after_the_deadline() -> None:
    sequence = AttemptSequence(plan("a", "b"), AttemptLimits(3, 1), deadline_s=5.0)
    assert sequence.next(5.0) == GiveUp("deadline")


def test_a_connect_waits_some_round_trips_of_the_region_within_the_floor_and_the_ceiling() -> None:
    timeout = ConnectTimeout(rtts=3.0, min_s=0.25, max_s=2.0)
    assert timeout.of(150.0) == pytest.approx(0.45)  # a far region: three of its round trips
    assert timeout.of(5.0) == 0.25  # a near one: the floor (a busy loop, a scheduler's jitter)
    assert timeout.of(0.0) == 0.25  # an edge node beside the PoP
    assert timeout.of(1_000.0) == 2.0  # never past the operator's ceiling
