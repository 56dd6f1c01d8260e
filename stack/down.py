"""`meridian down`: stop exactly what `meridian up` recorded, and nothing else.

A `meridian up` still running (in the foreground, or detached but still starting) is asked to
stop its own stack (SIGTERM: it stops its children in order and clears the state). Whatever is
then still recorded — a detached stack, or one whose `up` died — is stopped here, process by
process, each only if its PID still belongs to the process `up` started (same start time).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from stack import processes
from stack.state import StateDir
from stack.supervisor import Say

SUPERVISOR_TIMEOUT_S: Final = 90.0  # its own ordered stop is bounded well below this
POLL_S: Final = 0.2


def _stop_supervisor(pid: int, is_running: Callable[[], bool], say: Say) -> bool:
    """SIGTERM a foreground `meridian up` and wait for it; False if it did not exit in time."""
    say(f"asking meridian up (pid {pid}) to stop its stack…")
    try:
        os.kill(pid, signal.SIGTERM)  # the process alone: never its terminal's process group
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + SUPERVISOR_TIMEOUT_S
    while time.monotonic() < deadline:
        if not is_running():
            return True
        time.sleep(POLL_S)
    return False


def down(state_root: Path, say: Say) -> int:
    state_dir = StateDir(state_root)
    state = state_dir.read()
    if state is None:
        say(f"no stack recorded in {state_root}: nothing to stop")
        return 0
    supervisor = state.supervisor
    is_own_process = supervisor.pid == os.getpid()
    # A foreground `up`, or a detached one still starting: it stops what it started itself.
    if not is_own_process and supervisor.is_running():
        if _stop_supervisor(supervisor.pid, supervisor.is_running, say):
            state = state_dir.read()
            if state is None:
                say("stopped.")
                return 0
        else:
            say(f"meridian up (pid {supervisor.pid}) did not stop in time; stopping its children")
    left = [record for record in state.processes if record.is_running()]
    if left:
        say(f"stopping {len(left)} processes…")
        processes.stop_all(state.processes, say=say)  # each one checked again, by start time
    still = [record for record in state.processes if record.is_running()]
    if still:
        names = ", ".join(f"{r.name} (pid {r.pid})" for r in still)
        say(f"error: still running: {names}; state kept in {state_dir.state_path}")
        return 1
    state_dir.clear()
    say("stopped." if left else "nothing was running; cleared the stale state.")
    return 0
