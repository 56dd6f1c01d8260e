"""Starting the stack's processes (each in its own session, logging to a file) and stopping
exactly those, by recorded PID and start time.

Each child leads a new session, so a Ctrl-C at the terminal reaches only `meridian up`, which
then stops the children in order; and `down` can signal a child's whole process group (what it
spawned itself) once the leader is verified to be the very process `up` started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

from stack.state import ProcessRecord, process_start_time

# Stopping order: traffic in front first, the control plane and its database last (node agents
# drain on SIGTERM and report it; Envoys and the gateway watch the control plane until they go).
STOP_ORDER: Final = (
    "anycast-front",
    "gateway",
    "redis",
    "rtt-proxy",
    "node",
    "envoy",
    "picker",  # after its Envoy, which goes on without it anyway
    "control-plane",
    "postgres",  # after every replica has closed its connections
)
STOP_TIMEOUT_S: Final = {"node": 20.0, "gateway": 10.0}
DEFAULT_STOP_TIMEOUT_S: Final = 10.0
KILL_TIMEOUT_S: Final = 5.0
POLL_S: Final = 0.1

Reaper = Callable[[], None]


def spawn(
    name: str,
    kind: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    url: str | None = None,
) -> tuple[ProcessRecord, subprocess.Popen[bytes]]:
    """Start one child with its output appended to `log_path`; its record for the state file."""
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
    start_time = process_start_time(popen.pid) or "exited at start"
    record = ProcessRecord(name, kind, popen.pid, start_time, str(log_path), url)
    return record, popen


def send_signal(record: ProcessRecord, sig: int) -> bool:
    """Signal the recorded process (and its group, if it leads one) if it is still that very
    process; False if it is gone."""
    if not record.is_running():
        return False
    try:
        if os.getpgid(record.pid) == record.pid:
            os.killpg(record.pid, sig)
        else:
            os.kill(record.pid, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(records: Iterable[ProcessRecord], timeout_s: float, reap: Reaper | None) -> None:
    pending = list(records)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        if reap is not None:
            reap()
        pending = [record for record in pending if record.is_running()]
        if pending:
            time.sleep(POLL_S)
    if reap is not None:
        reap()


def stop_group(
    records: Sequence[ProcessRecord], timeout_s: float, reap: Reaper | None = None
) -> dict[str, str]:
    """SIGTERM every running record, wait up to `timeout_s`, then SIGKILL what is left.
    Returns, by name: stopped, killed, or not running."""
    outcome = {}
    signalled = []
    for record in records:
        if send_signal(record, signal.SIGTERM):
            signalled.append(record)
            outcome[record.name] = "stopped"
        else:
            outcome[record.name] = "not running"
    _wait_gone(signalled, timeout_s, reap)
    stubborn = [record for record in signalled if send_signal(record, signal.SIGKILL)]
    for record in stubborn:
        outcome[record.name] = f"killed (no exit within {timeout_s:g} s of SIGTERM)"
    _wait_gone(stubborn, KILL_TIMEOUT_S, reap)
    return outcome


def stop_all(
    records: Sequence[ProcessRecord],
    reap: Reaper | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """Stop the records kind by kind in `STOP_ORDER` (unknown kinds last)."""
    by_kind: dict[str, list[ProcessRecord]] = {}
    for record in records:
        by_kind.setdefault(record.kind, []).append(record)
    kinds = [k for k in STOP_ORDER if k in by_kind] + [k for k in by_kind if k not in STOP_ORDER]
    outcome: dict[str, str] = {}
    for kind in kinds:
        group = stop_group(by_kind[kind], STOP_TIMEOUT_S.get(kind, DEFAULT_STOP_TIMEOUT_S), reap)
        if say is not None:
            for record in by_kind[kind]:
                say(f"  {record.name} (pid {record.pid}): {group[record.name]}")
        outcome |= group
    return outcome
