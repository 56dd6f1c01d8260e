"""A parallel worker that stops or hangs while starting fails the start within seconds, naming
the worker, rather than leaving the driver waiting out its 600 s start timeout: spawned stand-in
workers speaking the start protocol (engine/worker_start.py), and a real tensor-parallel engine
whose worker is stopped (SIGSTOP) as it starts."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import psutil
import pytest
from suite_env import child_env
from tiny_checkpoints import save_tiny_transformers_model

from engine.errors import WorkerStartupError
from engine.worker_start import JOINING, READY, STARTED, StartReporter, StartWatch, is_stopped

pytestmark = pytest.mark.slow  # starts processes

MAX_SILENCE_S = 1.0
NAMED_WITHIN_S = 15.0  # the silence limit, with room for a loaded machine
START_TIMEOUT_S = 600.0


def _stand_in(pipe: Connection, hangs: bool) -> None:
    """A worker that starts, joins, and then loads forever: beating, or hung with the GIL held
    (a regular expression that backtracks for ages), which silences its beats."""
    reporter = StartReporter(pipe)
    reporter.started()
    reporter.joining()
    if hangs:
        re.match(r"(a+)+$", "a" * 64 + "b")
    pipe.recv()


StandIn = tuple[BaseProcess, Connection]
StartStandIn = Callable[[bool], StandIn]


@pytest.fixture
def stand_ins() -> Iterator[StartStandIn]:
    """Spawn stand-in workers with `start(hangs)`; every one is killed at the end."""
    context = mp.get_context("spawn")
    started: list[StandIn] = []

    def start(hangs: bool) -> StandIn:
        ours, theirs = context.Pipe()
        name = f"stand-in {len(started) + 1}"
        process = context.Process(target=_stand_in, args=(theirs, hangs), name=name, daemon=True)
        process.start()
        theirs.close()
        started.append((process, ours))
        return process, ours

    yield start
    for process, _ in started:
        process.kill()
        process.join()


def watch_of(workers: list[StandIn]) -> StartWatch:
    return StartWatch(
        [pipe for _, pipe in workers], [p for p, _ in workers], MAX_SILENCE_S, START_TIMEOUT_S
    )


def test_a_worker_that_hangs_while_loading_is_named_within_seconds(
    stand_ins: StartStandIn,
) -> None:
    workers = [stand_ins(False), stand_ins(True)]
    watch = watch_of(workers)
    watch.wait_for(STARTED)
    watch.wait_for(JOINING)
    waited_from_s = time.monotonic()
    with pytest.raises(WorkerStartupError, match=r"worker stand-in 2 has sent nothing for"):
        watch.wait_for(READY)
    assert time.monotonic() - waited_from_s < NAMED_WITHIN_S


def test_a_worker_stopped_before_it_runs_our_code_is_named_within_seconds(
    stand_ins: StartStandIn,
) -> None:
    workers = [stand_ins(False), stand_ins(False)]
    stopped, _ = workers[0]
    assert stopped.pid is not None
    os.kill(stopped.pid, signal.SIGSTOP)  # still importing: it has said nothing yet
    started_s = time.monotonic()
    with pytest.raises(
        WorkerStartupError, match=r"worker stand-in 1 has been stopped by a signal for"
    ):
        watch_of(workers).wait_for(STARTED)
    assert time.monotonic() - started_s < NAMED_WITHIN_S
    assert is_stopped(stopped.pid)


def test_a_beating_worker_may_take_its_time(stand_ins: StartStandIn) -> None:
    workers = [stand_ins(False)]
    watch = watch_of(workers)
    watch.wait_for(STARTED)
    watch.wait_for(JOINING)
    # A slow load: its beats keep it alive past the silence limit, until the start's deadline.
    later = StartWatch(watch.pipes, watch.processes, MAX_SILENCE_S, timeout_s=4 * MAX_SILENCE_S)
    with pytest.raises(WorkerStartupError, match=r"stand-in 1 did not start in 4 s"):
        later.wait_for(READY)


def _start_script(folder: Path, body: str) -> subprocess.Popen[str]:
    """`python script.py` in a fresh process, as test_parallel.run_script, left running."""
    script = folder / "script.py"
    script.write_text("from engine import LLM\n\n" + textwrap.dedent(body))
    env = child_env()
    return subprocess.Popen(
        [sys.executable, str(script)], cwd=folder, env=env, stderr=subprocess.PIPE, text=True
    )


def _spawned_child(parent: subprocess.Popen[str], timeout_s: float = 120.0) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and parent.poll() is None:
        for child in psutil.Process(parent.pid).children():
            with contextlib.suppress(psutil.Error):
                if "spawn_main" in " ".join(child.cmdline()):
                    return child
        time.sleep(0.01)
    raise AssertionError("no worker was spawned")


def test_a_tp_worker_stopped_while_starting_fails_the_engine_naming_it(tmp_path: Path) -> None:
    save_tiny_transformers_model(tmp_path / "model", "llama")
    driver = _start_script(
        tmp_path,
        f"""
        if __name__ == "__main__":
            LLM({str(tmp_path / "model")!r}, dtype="float32", tensor_parallel_size=2)
            print("built the engine")
        """,
    )
    children: list[psutil.Process] = []
    try:
        worker = _spawned_child(driver)
        children.append(worker)
        worker.suspend()  # SIGSTOP, as it starts
        stopped_s = time.monotonic()
        _, stderr = driver.communicate(timeout=START_TIMEOUT_S / 4)
        took_s = time.monotonic() - stopped_s
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive  # the driver killed it
    finally:
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        driver.kill()
        driver.wait()
    assert driver.returncode != 0
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("engine.errors.WorkerStartupError: parallel worker rank 1"), last
    assert re.search(r"(stopped by a signal|has sent nothing) for [0-9.]+ s while starting", last)
    print(f"\nthe start failed {took_s:.1f} s after the worker was stopped: {last}")
    assert took_s < START_TIMEOUT_S / 10
