"""`meridian down` stops exactly what `up` recorded, by PID and start time, and nothing else;
and the state file that tells it what that is."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from bounded_wait import wait_until

from stack import processes
from stack.down import down
from stack.errors import StackError
from stack.preflight import check_not_running
from stack.state import ProcessRecord, StackState, StateDir, process_start_time
from stack.status import status

Sleeper = Callable[..., tuple[ProcessRecord, subprocess.Popen[bytes]]]  # conftest's `sleeper`


def _state(records: list[ProcessRecord], detached: bool = True) -> StackState:
    me = ProcessRecord("meridian up", "supervisor", 999_999_999, "gone", "")
    return StackState(
        supervisor=me,
        config="test.yaml",
        detached=detached,
        control_plane_url="http://127.0.0.1:1",
        gateway_url="https://127.0.0.1:1",
        processes=records,
    )


@pytest.mark.slow
def test_start_time_identifies_a_process_not_merely_its_pid(sleeper: Sleeper) -> None:
    record, popen = sleeper()
    assert record.start_time == process_start_time(popen.pid)
    assert record.is_running()
    assert not ProcessRecord("x", "node", popen.pid, "12345", "").is_running()  # a reused PID
    popen.kill()
    popen.wait()
    assert process_start_time(popen.pid) is None
    assert not record.is_running()


@pytest.mark.slow
def test_a_zombie_is_not_running(sleeper: Sleeper) -> None:
    record, popen = sleeper()
    popen.kill()
    stat = Path(f"/proc/{popen.pid}/stat")

    def is_zombie() -> bool:  # dead, not yet reaped
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"

    wait_until(is_zombie, 5, "the killed process to be a zombie", interval_s=0.02)
    assert not record.is_running()
    popen.wait()


@pytest.mark.slow
def test_down_stops_the_recorded_processes_and_spares_an_unrelated_one(
    state_dir: StateDir, sleeper: Sleeper
) -> None:
    node, node_popen = sleeper("node us-east-00", "node")
    gateway, gateway_popen = sleeper("gateway", "gateway")
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # The unrelated process's PID is in the state too, but with another start time: as if
        # the recorded process had died and the kernel had given its PID to something else.
        reused = ProcessRecord("node eu-west-00", "node", unrelated.pid, "1", "")
        state_dir.write(_state([node, gateway, reused]))
        said: list[str] = []

        assert down(state_dir.root, said.append) == 0

        assert node_popen.wait(timeout=5) == -signal.SIGTERM
        assert gateway_popen.wait(timeout=5) == -signal.SIGTERM
        assert unrelated.poll() is None
        assert f"  gateway (pid {gateway.pid}): stopped" in said
        assert f"  node us-east-00 (pid {node.pid}): stopped" in said
        # Not running as far as `down` can tell: it never signalled that PID.
        assert f"  node eu-west-00 (pid {unrelated.pid}): not running" in said
        assert said[-1] == "stopped."
        assert state_dir.read() is None
    finally:
        unrelated.kill()
        unrelated.wait()


@pytest.mark.slow
def test_down_kills_what_ignores_sigterm_after_its_timeout(
    state_dir: StateDir, sleeper: Sleeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "DEFAULT_STOP_TIMEOUT_S", 0.5)
    stubborn, popen = sleeper("envoy us-east", "envoy", ignore_sigterm=True)
    wait_until(
        lambda: "sleeping" in Path(stubborn.log).read_text(),
        10,
        "its SIGTERM handler to be in place",
        interval_s=0.05,
    )
    state_dir.write(_state([stubborn]))
    said: list[str] = []
    assert down(state_dir.root, said.append) == 0
    assert popen.wait(timeout=5) == -signal.SIGKILL
    assert any("killed (no exit within 0.5 s of SIGTERM)" in line for line in said)


@pytest.mark.slow
def test_down_stops_in_order_gateway_first_control_plane_last(
    state_dir: StateDir, sleeper: Sleeper
) -> None:
    records = [
        sleeper("control-plane", "control-plane")[0],
        sleeper("node a", "node")[0],
        sleeper("envoy a", "envoy")[0],
        sleeper("gateway", "gateway")[0],
        sleeper("rtt-proxy", "rtt-proxy")[0],
    ]
    state_dir.write(_state(records))
    said: list[str] = []
    down(state_dir.root, said.append)
    order = [line.split(" (pid")[0].strip() for line in said if "(pid" in line]
    assert order == ["gateway", "rtt-proxy", "node a", "envoy a", "control-plane"]


@pytest.mark.slow
def test_down_asks_a_foreground_up_to_stop_its_own_stack(state_dir: StateDir) -> None:
    # A stand-in for a foreground `meridian up`: on SIGTERM it clears the state and exits.
    code = (
        "import pathlib, signal, sys, time\n"
        f"state = pathlib.Path({str(state_dir.state_path)!r})\n"
        "def stop(*_):\n    state.unlink()\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert supervisor.stdout is not None and supervisor.stdout.readline() == b"ready\n"
        start_time = process_start_time(supervisor.pid)
        assert start_time is not None
        state = _state([], detached=False)
        state.supervisor = ProcessRecord(
            "meridian up", "supervisor", supervisor.pid, start_time, ""
        )
        state_dir.write(state)
        said: list[str] = []
        assert down(state_dir.root, said.append) == 0
        assert supervisor.wait(timeout=5) == 0
        assert said == [f"asking meridian up (pid {supervisor.pid}) to stop its stack…", "stopped."]
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        supervisor.wait()
        assert supervisor.stdout is not None
        supervisor.stdout.close()


def test_down_with_nothing_recorded_is_a_no_op(tmp_path: Path) -> None:
    said: list[str] = []
    assert down(tmp_path / "none", said.append) == 0
    assert said == [f"no stack recorded in {tmp_path / 'none'}: nothing to stop"]


@pytest.mark.slow
def test_stale_state_is_cleared_and_a_live_stack_refused(
    state_dir: StateDir, sleeper: Sleeper
) -> None:
    dead = ProcessRecord("gateway", "gateway", 999_999_999, "gone", "")
    state_dir.write(_state([dead]))
    check_not_running(state_dir)  # nothing alive: the state is stale and goes
    assert state_dir.read() is None

    alive, _ = sleeper("node us-east-00")
    state_dir.write(_state([alive]))
    with pytest.raises(StackError, match=r"a stack is already running from .* \(1 processes"):
        check_not_running(state_dir)


@pytest.mark.slow
def test_state_round_trips_and_a_damaged_file_is_one_line(
    state_dir: StateDir, sleeper: Sleeper
) -> None:
    record, _ = sleeper()
    state = _state([record])
    state.ca_cert = "/x/ca.pem"
    state_dir.write(state)
    assert state_dir.read() == state
    assert json.loads(state_dir.state_path.read_text())["version"] == 1

    state_dir.state_path.write_text("{not json")
    with pytest.raises(StackError, match=r"state\.json is damaged"):
        state_dir.read()
    state_dir.state_path.write_text(json.dumps({"version": 99}))
    with pytest.raises(StackError, match="unknown state version 99"):
        state_dir.read()


def test_tokens_file_is_private(state_dir: StateDir) -> None:
    state_dir.write_tokens({"MERIDIAN_ADMIN_TOKEN": "adm-secret"})
    assert state_dir.tokens_path.stat().st_mode & 0o777 == 0o600
    assert state_dir.read_tokens() == {"MERIDIAN_ADMIN_TOKEN": "adm-secret"}


@pytest.mark.slow
def test_status_lists_processes_and_says_when_the_control_plane_is_unreachable(
    state_dir: StateDir, sleeper: Sleeper
) -> None:
    alive, _ = sleeper("node us-east-00")
    dead = ProcessRecord("gateway", "gateway", 999_999_999, "gone", "/x/gateway.log")
    state_dir.write(_state([alive, dead]))
    said: list[str] = []
    assert status(state_dir.root, said.append) == 1  # something is down
    text = "\n".join(said)
    assert re.search(rf"node us-east-00 +{alive.pid} +up +", text)
    assert re.search(r"gateway +999999999 +DOWN +/x/gateway.log", text)
    assert "control plane http://127.0.0.1:1: not reachable (ConnectError)" in text


def test_status_without_a_stack(tmp_path: Path) -> None:
    said: list[str] = []
    assert status(tmp_path, said.append) == 1
    assert said[0].startswith("no stack is running")


@pytest.mark.slow
def test_signal_goes_to_the_process_group_only_when_the_record_leads_it(
    sleeper: Sleeper,
) -> None:
    record, popen = sleeper()
    assert os.getpgid(popen.pid) == popen.pid  # started in its own session, as `up` does
    assert processes.send_signal(record, signal.SIGTERM)
    assert popen.wait(timeout=5) == -signal.SIGTERM
    assert not processes.send_signal(record, signal.SIGTERM)
