"""Fixtures for the stack's tests: a private state directory, and throwaway processes (plain
`sleep`s) that are always reaped, whatever a test did to them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stack import processes
from stack.state import ProcessRecord, StateDir

Sleeper = Callable[..., tuple[ProcessRecord, subprocess.Popen[bytes]]]


@pytest.fixture
def state_dir(tmp_path: Path) -> StateDir:
    state_dir = StateDir(tmp_path / "stack")
    state_dir.prepare()
    return state_dir


@pytest.fixture
def sleeper(state_dir: StateDir) -> Iterator[Sleeper]:
    """Factory: start a process that sleeps (optionally ignoring SIGTERM), as `up` starts its
    children; every one is killed and reaped at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(
        name: str = "dummy", kind: str = "node", ignore_sigterm: bool = False
    ) -> tuple[ProcessRecord, subprocess.Popen[bytes]]:
        code = "import signal, time\n"
        if ignore_sigterm:
            code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        code += "print('sleeping', flush=True)\ntime.sleep(120)\n"
        record, popen = processes.spawn(
            name, kind, [sys.executable, "-c", code], {}, state_dir.log_path(name)
        )
        started.append(popen)
        return record, popen

    yield start
    for popen in started:
        if popen.poll() is None:
            popen.kill()
        popen.wait(timeout=10)
