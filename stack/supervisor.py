"""The children of one `meridian up`: started and recorded in the state file as they go, waited
on until ready (each with its own deadline), watched while the stack runs, stopped in order."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from stack import processes
from stack.commands import Command
from stack.errors import StackError
from stack.state import ProcessRecord, StackState, StateDir

POLL_S: Final = 0.25
MAX_LOG_LINE = 300

Say = Callable[[str], None]


def last_log_line(path: str) -> str:
    """The last non-empty line of a log (what a failed process said last)."""
    try:
        with Path(path).open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 8192))
            lines = log.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.strip():
            return line.strip()[:MAX_LOG_LINE]
    return ""


@dataclass(slots=True)
class Child:
    record: ProcessRecord
    popen: subprocess.Popen[bytes]
    started_at: float  # monotonic
    is_reported_exited: bool = False

    def exit_status(self) -> int | None:
        return self.popen.poll()


@dataclass(slots=True)
class ReadyCheck:
    """A component is ready when `probe()` is true; it fails if `child` exits first, or when
    `timeout_s` passes."""

    label: str
    probe: Callable[[], bool]
    timeout_s: float
    child: Child | None = None
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, state_dir: StateDir, state: StackState, say: Say) -> None:
        self.state_dir = state_dir
        self.state = state
        self.say = say
        self.children: list[Child] = []

    def start(self, command: Command) -> Child:
        self.say(f"  starting {command.name}…")
        log_path = self.state_dir.log_path(command.name)
        record, popen = processes.spawn(
            command.name, command.kind, command.argv, command.env, log_path, command.url
        )
        child = Child(record, popen, time.monotonic())
        self.children.append(child)
        self.state.processes.append(record)
        self.state_dir.write(self.state)
        return child

    def reap(self) -> None:
        for child in self.children:
            child.popen.poll()

    def wait_ready(self, checks: list[ReadyCheck]) -> None:
        """Poll every check until all pass; StackError (one line) on an exit or a timeout."""
        pending = list(checks)
        while pending:
            for check in list(pending):
                elapsed_s = time.monotonic() - check.started_at
                if check.child is not None and check.child.exit_status() is not None:
                    raise self._exited_error(check.label, check.child)
                if check.probe():
                    self.say(f"  {check.label} ready in {elapsed_s:.1f} s")
                    pending.remove(check)
                elif elapsed_s > check.timeout_s:
                    log = f"; log: {check.child.record.log}" if check.child else ""
                    raise StackError(f"{check.label} not ready after {check.timeout_s:g} s{log}")
            if pending:
                time.sleep(POLL_S)

    def _exited_error(self, label: str, child: Child) -> StackError:
        said = last_log_line(child.record.log)
        return StackError(
            f"{label} exited with status {child.exit_status()} while starting"
            + (f": {said}" if said else "")
            + f" (log: {child.record.log})"
        )

    def report_exits(self) -> None:
        """Say once about each child that has exited on its own while the stack runs."""
        for child in self.children:
            status = child.exit_status()
            if status is not None and not child.is_reported_exited:
                child.is_reported_exited = True
                self.say(
                    f"warning: {child.record.name} (pid {child.record.pid}) exited with status "
                    f"{status}; log: {child.record.log}"
                )

    def stop_all(self) -> None:
        records = [child.record for child in self.children]
        processes.stop_all(records, self.reap, self.say)
        self.reap()
