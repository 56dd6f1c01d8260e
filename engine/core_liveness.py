"""Whether an engine core process still answers: signs of life it leaves in memory shared with
its client (engine/core_client.py), and the client's verdict on them.

The core counts two things into a small shared array, with no pipe and no lock between them:
the ticks of a thread of its own, every `TICK_S`, which prove that the process runs (a stopped
process, by SIGSTOP or a frozen container, ticks no more), and the turns of its loop, with
whether one is under way, which prove that the loop moves on (a step that never ends, a hung
device or a deadlock, leaves one turn under way while the ticks go on). A long prefill step is
not silence: the ticks go on through it, and only a turn past `max_step_s` counts. The client
samples the array on a clock of its own; `LivenessWatch` is the pure judgement of the samples.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from multiprocessing.context import BaseContext

TICK_S = 0.25  # the core's ticks, and the client's samples
_TICKS, _TURNS, _IS_IN_TURN = range(3)


@dataclass(frozen=True, slots=True)
class LivenessLimits:
    max_silence_s: float  # no tick for this long: the core's process does not run
    max_step_s: float  # one turn of its loop under way this long: the loop is stuck


class CoreSigns:
    """The shared array: made by the client, handed to the core's process when it is started
    (it pickles only then), written there and read here."""

    def __init__(self, context: BaseContext) -> None:
        self._values = context.RawArray("q", 3)

    def tick_until(self, stopped: threading.Event) -> None:
        """The core's ticker thread."""
        while not stopped.wait(TICK_S):
            self._values[_TICKS] += 1

    def begin_turn(self) -> None:
        self._values[_TURNS] += 1
        self._values[_IS_IN_TURN] = 1

    def end_turn(self) -> None:
        """The loop waits for commands: no step is under way."""
        self._values[_IS_IN_TURN] = 0

    def read(self) -> tuple[int, int, bool]:
        """(ticks, turns, whether a turn is under way)."""
        values = self._values
        return values[_TICKS], values[_TURNS], bool(values[_IS_IN_TURN])


@dataclass(slots=True)
class LivenessWatch:
    """The client's judgement of successive samples, taken at `now_s` on its own clock."""

    limits: LivenessLimits
    _ticks: int = -1
    _turns: int = -1
    _ticked_at_s: float = 0.0  # when the ticks were last seen to move
    _turned_at_s: float = 0.0  # when the loop was last seen between turns or in a new one
    _sampled_at_s: float | None = None

    def check(self, signs: tuple[int, int, bool], now_s: float) -> str | None:
        """Why the core does not answer now, or None while it does."""
        ticks, turns, is_in_turn = signs
        last_sampled_s, self._sampled_at_s = self._sampled_at_s, now_s
        # Silence counts only while this side watched: after a stall of the watcher's own (its
        # process starved or stopped, the machine suspended) the core gets a fresh start.
        if last_sampled_s is None or now_s - last_sampled_s > self.limits.max_silence_s / 2:
            self._ticked_at_s = self._turned_at_s = now_s
        if ticks != self._ticks:
            self._ticks, self._ticked_at_s = ticks, now_s
        if turns != self._turns or not is_in_turn:
            self._turns, self._turned_at_s = turns, now_s
        silent_s = now_s - self._ticked_at_s
        if silent_s > self.limits.max_silence_s:
            return f"its process has given no sign of life for {silent_s:.1f} s"
        step_s = now_s - self._turned_at_s
        if step_s > self.limits.max_step_s:
            return f"one step of its loop has run for {step_s:.1f} s"
        return None
