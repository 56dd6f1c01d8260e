"""`meridian status` for the global front end: the limits mode that is live (a PoP whose
redis-server died limits in its gateway process until it is back), each PoP's health, and an
unreachable Anycast front named in one line."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from stack.certs import ensure_gateway_tls
from stack.state import ProcessRecord, StackState, StateDir
from stack.status import pop_tiers, status

Sleeper = Callable[..., tuple[ProcessRecord, subprocess.Popen[bytes]]]  # conftest's `sleeper`
SHARED = (
    "across PoPs by the control plane's shares; each PoP's buckets in a redis-server of its own "
    "(ports 6390, 6391)"
)


def _state(records: list[ProcessRecord], ca_cert: Path) -> StackState:
    me = ProcessRecord("meridian up", "supervisor", 999_999_999, "gone", "")
    return StackState(
        supervisor=me,
        config="test.yaml",
        detached=True,
        control_plane_url="http://127.0.0.1:1",
        gateway_url="https://127.0.1.1:1",
        pops={"new-york": "https://127.0.1.1:1", "london": "https://127.0.1.2:1"},
        anycast_url="http://127.0.0.1:1",
        dns_name="api.meridian.test",
        dns_port=8053,
        dns_ports=[8053, 8054],
        limits=SHARED,
        ca_cert=str(ca_cert),
        processes=records,
    )


@pytest.mark.slow
def test_status_says_which_limits_are_live_and_what_of_the_front_answers(
    state_dir: StateDir, sleeper: Sleeper
) -> None:
    new_york, popen = sleeper("redis new-york", "redis")
    london, _ = sleeper("redis london", "redis")
    state_dir.write(_state([new_york, london], ensure_gateway_tls(state_dir.tls_dir).ca_cert))
    said: list[str] = []
    status(state_dir.root, said.append)
    text = "\n".join(said)
    assert f"limits: {SHARED}" in text
    assert (
        "DNS: api.meridian.test on udp 127.0.0.1:8053, 127.0.0.1:8054 "
        "(one per control-plane replica)" in text
    )
    assert "new-york  https://127.0.1.1:1  not reachable (ConnectError)" in text
    assert "Anycast front http://127.0.0.1:1: not reachable (ConnectError)" in text
    popen.kill()
    popen.wait()
    said.clear()
    status(state_dir.root, said.append)
    assert (
        f"limits: {SHARED}; redis-server DOWN at new-york: limiting in the gateway process "
        "there, from the levels last seen" in "\n".join(said)
    )


def test_a_pops_tiers_say_when_its_edge_is_cut_off() -> None:
    edge = {"url": "http://127.0.0.1:1", "in_flight": 0, "max_concurrency": 4}
    assert pop_tiers({"status": "ok", "edge": None}) == "region"
    assert pop_tiers({"status": "ok", "edge": edge | {"breaker": "closed"}}) == "edge+region"
    assert pop_tiers({"edge": edge | {"breaker": "open"}}) == "edge (breaker open)+region"
