"""A real `meridian up` with `control_plane: {replicas: 2, db: postgres}` (one region of one node,
one PoP, no clients): PostgreSQL and both replicas start, `status` names the leader; SIGKILL the
leader and the other takes over, the node keeps beating (healthy past the unhealthy timeout) and
the gateway still serves a chat completion; `down` stops PostgreSQL too."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from bounded_wait import wait_until
from port_blocks import random_block_base
from suite_env import child_env

from stack.commands import ADMIN_TOKEN
from stack.servers import PostgresNotFoundError, postgres_bin_dir
from stack.state import StateDir

REPO_ROOT = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 420
# (name in `ports`, how many consecutive ports from it the stack uses)
PORT_BLOCKS = (
    ("control_plane", 2),
    ("xds", 2),
    ("dns", 2),
    ("gateway", 1),
    ("postgres", 1),
    ("node_base", 1),
    ("envoy_base", 1),
    ("envoy_admin_base", 1),
    ("gateway_metrics", 1),  # not the default 9464: another stack test may run beside this one
)

pytestmark = pytest.mark.slow


def _is_free(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_block(size: int, taken: set[int]) -> int:
    """The first of `size` consecutive free ports (TCP and UDP)."""
    while True:
        base = random_block_base(span=size, step=1)
        block = range(base, base + size)
        if not taken & set(block) and all(map(_is_free, block)):
            taken.update(block)
            return base


def _meridian(
    state: Path, command: str, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = child_env(keep=("MERIDIAN_HOME",))  # the model store
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-m", "stack", command, "--state-dir", str(state), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def _status_of(url: str, token: str) -> dict[str, Any] | None:
    try:
        response = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def test_two_replicas_on_postgres_survive_the_leaders_death(tmp_path: Path) -> None:
    pytest.importorskip("psycopg", reason="psycopg is not installed (meridian[postgres])")
    try:
        postgres_bin_dir()
    except PostgresNotFoundError as exc:
        pytest.skip(str(exc))
    taken: set[int] = set()
    ports = ", ".join(f"{name}: {_free_block(size, taken)}" for name, size in PORT_BLOCKS)
    config = tmp_path / "stack.yaml"
    config.write_text(
        "regions: [{name: us-east, nodes: 1}]\npops: [new-york]\nclients: []\n"
        "limits: local\nsimulate_rtt: false\nnode: {kv_cache_gib: 0.1, max_num_seqs: 4}\n"
        f"control_plane: {{replicas: 2, db: postgres}}\nports: {{{ports}}}\n"
    )
    # Run by root, this is under a directory closed to others (pytest's tmp_path, 0700 above
    # it), as root's default under /root: the cluster goes to the temp directory instead.
    state = tmp_path / "state"
    try:
        _up_kill_down(config, state)
    finally:
        shutil.rmtree(StateDir(state).postgres_dir, ignore_errors=True)


def _up_kill_down(config: Path, state: Path) -> None:
    up = _meridian(state, "up", "--config", str(config), "--detach", timeout=UP_TIMEOUT_S)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-2000:]
        _check_failover(state, up.stdout)
    finally:
        down = _meridian(state, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "postgres (pid" in down.stdout
    assert not (state / "state.json").exists()


def _check_failover(state: Path, up_output: str) -> None:
    recorded = StateDir(state).read()
    assert recorded is not None
    token = StateDir(state).read_tokens()[ADMIN_TOKEN]
    assert list(recorded.control_planes) == ["control-plane 1", "control-plane 2"]
    postgres = next(r for r in recorded.processes if r.kind == "postgres")
    assert postgres.is_running()

    status = _meridian(state, "status")
    roles = re.findall(r"control-plane (\d)\s+http\S+\s+(leader|follower)", status.stdout)
    assert sorted(role for _, role in roles) == ["follower", "leader"], status.stdout
    leader_name = next(f"control-plane {n}" for n, role in roles if role == "leader")
    survivor_url = next(u for name, u in recorded.control_planes.items() if name != leader_name)
    leader = next(r for r in recorded.processes if r.name == leader_name)

    os.kill(leader.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(
        lambda: (s := _status_of(survivor_url, token)) is not None and s["replica"]["is_leader"],
        20.0,
        "the other replica to lead",
        interval_s=0.25,
    )
    # Past the unhealthy timeout since the kill, the node is still healthy on the survivor:
    # its beats reached it (sent there, or failed over to it).
    fleet = _status_of(survivor_url, token)
    assert fleet is not None
    # The time passing IS what is tested: the node must not turn unhealthy over it.
    time.sleep(max(0.0, fleet["unhealthy_after_s"] + 1.0 - (time.monotonic() - killed_at)))
    fleet = _status_of(survivor_url, token)
    assert fleet is not None
    assert [(n["node_id"], n["is_healthy"]) for n in fleet["nodes"]] == [("us-east-00", True)]
    # The region's Envoy is on the survivor's xDS (it was, or its ADS stream moved there).
    wait_until(
        lambda: (_status_of(survivor_url, token) or {}).get("xds", {}).get("num_envoys"),
        20.0,
        "the Envoy on the survivor's xDS",
        interval_s=0.25,
    )

    (key,) = re.findall(r"API key\s+(\S+)\s+\(shown once", up_output)
    context = httpx.create_ssl_context(verify=recorded.ca_cert)
    response = httpx.post(
        f"{recorded.gateway_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "auto", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
        verify=context,
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    after = _meridian(state, "status")
    assert re.search(rf"{leader_name}\s+\d+\s+DOWN", after.stdout), after.stdout
