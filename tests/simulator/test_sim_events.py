"""The event loop: time order, ties in scheduling order, never back in time."""

from __future__ import annotations

from simulator.events import EventLoop


def test_events_run_in_time_order_and_ties_in_the_order_scheduled() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []

    def note(name: str) -> None:
        seen.append((loop.now_s, name))

    loop.at(2.0, note, "late")
    loop.at(1.0, note, "first")
    loop.at(1.0, note, "second")
    loop.run()
    assert seen == [(1.0, "first"), (1.0, "second"), (2.0, "late")]


def test_an_event_in_the_past_runs_now_and_run_stops_at_its_horizon() -> None:
    loop = EventLoop()
    seen: list[float] = []
    loop.at(5.0, lambda _: loop.at(1.0, lambda _: seen.append(loop.now_s)))
    loop.at(9.0, lambda _: seen.append(loop.now_s))
    loop.run(until_s=6.0)
    assert seen == [5.0] and loop.num_pending == 1
