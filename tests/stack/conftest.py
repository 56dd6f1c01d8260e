"""Fixtures for the stack's tests: a private state directory, throwaway processes (plain `sleep`s)
that are always reaped, whatever a test did to them, and a machine without the Redis and
PostgreSQL servers (the system's, the wheels' or both)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stack import processes, servers
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


@pytest.fixture
def no_wheels(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine where the `stack` extra's wheels are not installed."""
    monkeypatch.setattr(servers, "REDIS_WHEEL", ("meridian_no_such_wheel", "bin/redis-server"))
    monkeypatch.setattr(servers, "POSTGRES_WHEEL", ("meridian_no_such_wheel", "bin"))


@pytest.fixture
def no_system_servers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As on a fresh machine: no redis-server or pg_ctl on PATH, no Debian PostgreSQL. Returns
    the (empty) directory that is all of PATH."""
    path_dir = tmp_path / "path"
    path_dir.mkdir()
    monkeypatch.setenv("PATH", str(path_dir))
    monkeypatch.setattr(servers, "SYSTEM_POSTGRES_GLOB", str(tmp_path / "lib/postgresql/*/bin"))
    return path_dir
