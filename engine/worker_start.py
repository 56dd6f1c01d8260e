"""A parallel worker's start-up as the driver follows it: the worker says how far it has come and
beats while it gets there, so that one that stops (SIGSTOP, a hang) is named within seconds
rather than leaving the driver waiting out its start timeout.

Over the worker's pipe, before its first step: `STARTED` (it runs our code: its interpreter and
imports are done), `JOINING` (its device is set up: it enters the process group's rendezvous),
`READY` (its weights and KV cache are in place), and `BEAT` every `BEAT_S` in between, from a
thread of its own, which goes on beating through a long weights load. The driver waits for each
message from every worker in turn (`StartWatch.wait_for`) and gives up, naming the worker, on
one that exits, on one heard from before that then sends nothing for `max_silence_s`, or at the
start's deadline. Before `STARTED` a worker runs nothing of ours (the spawned interpreter
imports the main module and ours, seconds), and sends nothing: there the driver also looks at
the process itself, and one stopped by a signal for `max_silence_s` fails the start as well
(Linux's /proc; elsewhere only the deadline bounds that wait).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from multiprocessing.process import BaseProcess
from pathlib import Path

from engine.errors import WorkerStartupError

STARTED, JOINING, READY, BEAT = "started", "joining", "ready", "beat"
BEAT_S = 0.5
_POLL_S = 0.1
_JOIN_TIMEOUT_S = 10.0
MAIN_GUARD_HINT = (
    "Workers are spawned: each one first re-imports the main script, so a script that builds "
    "LLM(tensor_parallel_size=...) or LLM(pipeline_parallel_size=...) at import time builds "
    "one again inside every worker, which cannot start processes of its own and dies. Put "
    'that code under `if __name__ == "__main__":` (the worker\'s traceback is above).'
)


class StartReporter:
    """The worker's side: its messages, with beats from `started` until `ready`."""

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()  # the beats and the main thread share the pipe
        self._stopped = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="start-beats", daemon=True)

    def started(self) -> None:
        self._send(STARTED)
        self._beats.start()

    def joining(self) -> None:
        self._send(JOINING)

    def ready(self) -> None:
        """The last word of the start: no beat follows it down the pipe."""
        self._stopped.set()
        self._beats.join()
        self._send(READY)

    def _beat(self) -> None:
        while not self._stopped.wait(BEAT_S):
            try:
                self._send(BEAT)
            except OSError:
                return  # the driver is gone; the main thread learns it from the pipe

    def _send(self, message: str) -> None:
        with self._lock:
            self._pipe.send(message)


@dataclass(slots=True)
class StartWatch:
    """The driver's side: every worker's pipe and process, in rank order."""

    pipes: list[Connection]
    processes: list[BaseProcess]
    max_silence_s: float
    timeout_s: float
    _deadline_s: float = 0.0
    _heard_at_s: dict[int, float] = field(default_factory=dict)  # by worker index
    _stopped_since_s: dict[int, float] = field(default_factory=dict)  # seen stopped since

    def __post_init__(self) -> None:
        self._deadline_s = time.monotonic() + self.timeout_s

    def wait_for(self, message: str) -> None:
        """Until every worker has sent `message`; WorkerStartupError naming the worker that
        exits, falls silent, or keeps the start past its deadline."""
        pending = set(range(len(self.pipes)))
        while pending:
            wait_for_connections([self.pipes[i] for i in pending], _POLL_S)
            self._look(pending, message)
            if pending and time.monotonic() > self._deadline_s:
                names = ", ".join(self.processes[i].name for i in sorted(pending))
                raise WorkerStartupError(f"{names} did not start in {self.timeout_s:g} s")

    def raise_if_failed(self) -> None:
        """One look, without waiting: WorkerStartupError if a worker has exited or fallen
        silent (what made the driver's own part of the start fail, if it was a worker)."""
        self._look(set(range(len(self.pipes))), None)

    def _look(self, pending: set[int], message: str | None) -> None:
        """Read what the workers sent; those that sent `message` leave `pending`."""
        now_s = time.monotonic()
        for i in list(pending):
            if self._read_until(i, message, now_s):
                pending.discard(i)
        for i, process in enumerate(self.processes):
            if not process.is_alive():
                raise self._died(i)
        self._raise_if_silent(pending, now_s)
        self._raise_if_stopped(pending, now_s)

    def _read_until(self, i: int, message: str | None, now_s: float) -> bool:
        """Read worker `i`'s pipe up to `message` (True) or until it is empty (False)."""
        pipe = self.pipes[i]
        while pipe.poll():
            try:
                got = pipe.recv()
            except EOFError:
                raise self._died(i) from None
            self._heard_at_s[i] = now_s
            if got == message:
                return True
            if got != BEAT:
                raise WorkerStartupError(
                    f"parallel worker {self.processes[i].name} said {got!r} while starting, "
                    f"where {message!r} was awaited"
                )
        return False

    def _raise_if_silent(self, pending: set[int], now_s: float) -> None:
        heard = [i for i in pending if i in self._heard_at_s]
        if not heard:
            return
        i = min(heard, key=self._heard_at_s.__getitem__)
        silent_s = now_s - self._heard_at_s[i]
        if silent_s > self.max_silence_s:
            raise WorkerStartupError(
                f"parallel worker {self.processes[i].name} has sent nothing for {silent_s:.1f} s "
                f"while starting: it is stopped or hung"
            )

    def _raise_if_stopped(self, pending: set[int], now_s: float) -> None:
        for i in pending:
            pid = self.processes[i].pid
            if pid is None or not is_stopped(pid):
                self._stopped_since_s.pop(i, None)
                continue
            stopped_s = now_s - self._stopped_since_s.setdefault(i, now_s)
            if stopped_s > self.max_silence_s:
                raise WorkerStartupError(
                    f"parallel worker {self.processes[i].name} has been stopped by a signal "
                    f"for {stopped_s:.1f} s while starting"
                )

    def _died(self, i: int) -> WorkerStartupError:
        process = self.processes[i]
        process.join(_JOIN_TIMEOUT_S)
        if i in self._heard_at_s:
            hint = "Its traceback is above."
        else:  # it died before it ran our code: in its imports
            # Only a main module read from a file is imported again by spawned workers.
            has_main_file = getattr(sys.modules["__main__"], "__file__", None) is not None
            hint = MAIN_GUARD_HINT if has_main_file else "Its traceback is above."
        return WorkerStartupError(
            f"parallel worker {process.name} exited (code {process.exitcode}) while starting"
            f"{'' if i in self._heard_at_s else ', before it could run'}. {hint}"
        )


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (SIGSTOP, SIGTSTP, a debugger); False
    where /proc cannot say (another OS, the process gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (command) state ...": the command may hold spaces and parentheses of its own.
    return stat[stat.rindex(")") + 2 :].startswith(("T", "t"))
