"""`pytest --unit` (what `make test-fast` adds to `-m 'not slow'`): every selected test that starts
a process or opens the real model fails, naming itself, so that an unmarked slow test cannot creep
into the edit-test loop."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import platform
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import gguf_file
from engine.gguf_file import GGUFFile
from engine.kernels import cpu_kernels

# Every test that uses one of these fixtures (directly or through another) is slow by definition:
# the real model, and a PostgreSQL server.
SLOW_FIXTURES = frozenset({"smollm2_gguf", "postgres_server"})

# Tiny test checkpoints are a few MB; the real model is about 270 MB.
REAL_MODEL_MIN_BYTES = 50 * 2**20
SLOW_HINT = "mark it `@pytest.mark.slow` (loads the real model or starts processes)"


class UnitGuardError(RuntimeError):
    """Raised where a test run with `--unit` starts a process or opens the real model."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--unit",
        action="store_true",
        help="fail any selected test that starts a process or opens the real model "
        "(`make test-fast` runs `-m 'not slow' --unit`)",
    )


class UnitGuard:
    """Wraps the ways a test starts a process or opens the real model so that each fails, naming
    the test, and records it: code under test may swallow the error, the report may not."""

    def __init__(self) -> None:
        self.current = ""  # the node id of the test running now, if any
        self.caught: dict[str, str] = {}  # by node id: what the test did
        self.reported: set[str] = set()  # tests whose own failure already says it

    def refuse(self, what: str) -> None:
        if not self.current:  # between tests: pytest's own (xdist starts its workers)
            return
        message = f"{self.current} {what}: {SLOW_HINT}"
        self.caught.setdefault(self.current, message)
        raise UnitGuardError(message)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start
        read_header = gguf_file._read  # what read_gguf calls on the mapped file

        def guarded_popen(popen: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
            self.refuse(f"starts a process ({args!r:.80})")
            popen_init(popen, args, *rest, **kw)

        def guarded_start(process: multiprocessing.process.BaseProcess) -> None:
            self.refuse(f"starts a process ({process.name})")
            process_start(process)

        def guarded_read(path: Path, buffer: np.memmap) -> GGUFFile:
            if len(buffer) >= REAL_MODEL_MIN_BYTES:
                self.refuse(f"opens the real model ({path})")
            return read_header(path, buffer)

        monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
        monkeypatch.setattr(gguf_file, "_read", guarded_read)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--unit"):
        # Built once per machine and sources (a minute, with the compiler as a process), then
        # cached by torch: build it before the guard, as any later run finds it built.
        cpu_kernels()
        # The processor's name is read from `uname -p` once, on first use (the openai client's
        # headers ask for it): read it before the guard, not in whichever test asks first.
        platform.processor()
        # matplotlib lists the system's fonts with `fc-list` once per machine, at its first
        # import (the simulator's plots): on a fresh machine the first plotting test did.
        with contextlib.suppress(ImportError):
            import matplotlib.font_manager  # noqa: F401
        guard = UnitGuard()
        patches = pytest.MonkeyPatch()
        guard.install(patches)
        config.stash[_GUARD] = guard
        config.add_cleanup(patches.undo)


_GUARD = pytest.StashKey[UnitGuard]()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    guard = item.config.stash.get(_GUARD, None)
    if guard is None:
        return (yield)
    guard.current = item.nodeid
    try:
        return (yield)
    finally:
        guard.current = ""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    guard = item.config.stash.get(_GUARD, None)
    if guard is None or item.nodeid not in guard.caught or item.nodeid in guard.reported:
        return report
    if report.failed or report.when == "teardown":
        guard.reported.add(item.nodeid)
    if report.when == "teardown" and not report.failed:  # the test swallowed the error
        report.outcome = "failed"
        report.longrepr = guard.caught[item.nodeid]
    return report
