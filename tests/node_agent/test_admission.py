"""Admission tickets and the drain state machine (no engine, no server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from node_agent.admission import Admission
from node_agent.drain import Drain
from node_agent.errors import DeflectedError, OverloadedError
from wire.deflection import attempt_of


def test_queue_depth_counts_requests_without_a_first_token() -> None:
    admission = Admission(max_num_waiting_requests=2, retry_after_s=3)
    first, second = admission.admit(0), admission.admit(0)
    with pytest.raises(OverloadedError) as refused:
        admission.admit(0)
    assert refused.value.headers() == {"Retry-After": "3"}
    first.mark_started()  # it produced a token: it no longer waits
    third = admission.admit(0)
    assert admission.num_in_flight == 3 and admission.num_not_started == 2
    # The engine's own count wins when it is larger (preempted requests wait again).
    with pytest.raises(OverloadedError):
        admission.admit(engine_num_waiting=5)
    for ticket in (first, second, third, third):  # releasing twice is harmless
        ticket.release()
    assert admission.num_in_flight == 0 and admission.num_not_started == 0
    assert admission.num_rejected == 2


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


def test_drain_waits_for_in_flight_then_calls_back_only_when_exiting() -> None:
    async def scenario() -> list[str]:
        events: list[str] = []
        admission = Admission(10, 1)
        drain = Drain(admission, timeout_s=5)
        drain.on_drained = lambda: events.append("drained")
        ticket = admission.admit(0)
        drain.begin("control plane", exit_when_drained=False)
        assert drain.is_draining
        await asyncio.sleep(0)  # a turn of the loop: the drain's task waits for the ticket
        assert drain.cancel()  # undrain before it finishes
        assert not drain.is_draining
        drain.begin("SIGTERM", exit_when_drained=True)
        assert not drain.cancel()  # an exit cannot be undone
        await asyncio.sleep(0)
        assert events == []  # the ticket is still in flight
        ticket.release()
        await until(lambda: events != [])
        return events

    assert asyncio.run(scenario()) == ["drained"]


def test_drain_upgraded_to_exit_after_it_finished_still_exits() -> None:
    async def scenario() -> list[str]:
        events: list[str] = []
        drain = Drain(Admission(10, 1), timeout_s=5)
        drain.on_drained = lambda: events.append("drained")
        drain.begin("control plane", exit_when_drained=False)
        await asyncio.sleep(0)  # a turn of the loop: the drain's task finds nothing in flight
        drain.begin("SIGTERM", exit_when_drained=True)
        return events

    assert asyncio.run(scenario()) == ["drained"]


def test_an_early_envoy_attempt_is_deflected_while_another_request_waits() -> None:
    admission = Admission(10, 1, deflect_at_waiting=1)
    first = admission.admit(0, attempt=1)  # nothing waits here: taken
    with pytest.raises(DeflectedError) as deflected:
        admission.admit(0, attempt=1)  # the first is still waiting for its first token
    assert deflected.value.status_code == 429
    assert deflected.value.headers() == {"x-meridian-deflected": "1"}
    second = admission.admit(0, attempt=2)  # Envoy's retry: past the last deflectable
    third = admission.admit(0, attempt=None)  # not through Envoy: never deflected
    assert admission.num_deflected == 1 and admission.num_in_flight == 3
    # Three waiting is a deep queue (past 1 + DEFLECT_WINDOW): the neighbours are as busy.
    admission.admit(0, attempt=1).release()
    for ticket in (first, second, third):
        ticket.mark_started()
    admission.admit(0, attempt=1).release()  # nothing waits any more
    with pytest.raises(DeflectedError):
        admission.admit(engine_num_waiting=1, attempt=1)  # the engine's count counts too
    assert Admission(10, 1, deflect_at_waiting=0).admit(5, attempt=1) is not None  # 0: off


def test_envoy_attempt_header_is_read_strictly() -> None:
    assert [attempt_of(h) for h in ("1", "3", None, "", "0", "-1", "x", "2.0")] == [
        1, 3, None, None, None, None, None, None,
    ]  # fmt: skip
