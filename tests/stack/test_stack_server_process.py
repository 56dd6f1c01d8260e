"""The stack's small servers as processes: a port that cannot be bound is one line and exit
status 1; SIGTERM sets the stop event."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from stack.server_process import run_server, stop_on_signals


async def _cannot_bind() -> None:
    raise OSError(98, "Address already in use")


async def _until_sigterm() -> None:
    stopped = stop_on_signals()
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(stopped.wait(), 5.0)


def test_a_server_that_cannot_listen_exits_1_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_server("proxy", "WARNING", _cannot_bind()) == 1
    assert capsys.readouterr().err == "proxy: error: cannot listen: Address already in use\n"


def test_sigterm_stops_a_server_and_it_exits_0() -> None:
    assert run_server("proxy", "WARNING", _until_sigterm()) == 0
