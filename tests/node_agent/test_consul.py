"""Consul registration through py-consul: against the stand-in of Consul's agent API here, or
against a real agent when CONSUL_HTTP_ADDR is set (CONSUL_HTTP_TOKEN too, if it needs one)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from consul_standin import ConsulStandIn
from fake_engine import FakeEngine
from node_helpers import MODEL_NAME, BackgroundLoop, free_port, start_node, wait_until

from node_agent.consul import parse_consul_addr


class ConsulView:
    """Reads the agent's view of services and checks over its plain HTTP API."""

    def __init__(self, addr: str):
        scheme, host, port = parse_consul_addr(addr)
        token = os.environ.get("CONSUL_HTTP_TOKEN")
        headers = {"X-Consul-Token": token} if token else {}
        self.addr = addr
        self.http = httpx.Client(base_url=f"{scheme}://{host}:{port}", headers=headers, timeout=5)

    def services(self) -> dict[str, Any]:
        result: dict[str, Any] = self.http.get("/v1/agent/services").json()
        return result

    def checks(self) -> dict[str, Any]:
        result: dict[str, Any] = self.http.get("/v1/agent/checks").json()
        return result

    def check_status(self, check_id: str) -> str | None:
        check = self.checks().get(check_id)
        return None if check is None else str(check["Status"])

    def deregister(self, service_id: str) -> None:
        self.http.put(f"/v1/agent/service/deregister/{service_id}").raise_for_status()


@pytest.fixture
def consul_agent(server_loop: BackgroundLoop) -> Iterator[ConsulView]:
    real = os.environ.get("CONSUL_HTTP_ADDR")
    if real:
        view = ConsulView(real)
        yield view
        view.http.close()
        return
    standin = ConsulStandIn(free_port())
    server_loop.run(standin.start())
    view = ConsulView(standin.addr)
    yield view
    view.http.close()
    server_loop.run(standin.stop())


def test_node_registers_keeps_its_ttl_check_and_deregisters(
    server_loop: BackgroundLoop, fake_llm: FakeEngine, consul_agent: ConsulView
) -> None:
    node = start_node(server_loop, fake_llm, consul=consul_agent.addr, heartbeat_interval_s=0.1)
    service_id = node.settings.node_id
    assert service_id is not None
    check_id = f"service:{service_id}"
    try:
        assert wait_until(lambda: consul_agent.check_status(check_id) == "passing")
        service = consul_agent.services()[service_id]
        assert service["Service"] == "meridian-node"
        assert service["Meta"]["region"] == "us-east"
        assert service["Meta"]["model"] == MODEL_NAME
        assert service["Port"] == node.settings.port
        assert service["Address"] == "127.0.0.1"

        # The agent forgets the service (say it restarted): the next ticks register it again.
        consul_agent.deregister(service_id)
        assert wait_until(lambda: consul_agent.check_status(check_id) == "passing")

        # Draining marks the check critical, with the reason as its output.
        server_loop.call(lambda: node.runtime.drain.begin("test", exit_when_drained=False))
        assert wait_until(lambda: consul_agent.check_status(check_id) == "critical")
        assert "draining" in consul_agent.checks()[check_id]["Output"]
    finally:
        node.stop()
    assert service_id not in consul_agent.services()
    assert check_id not in consul_agent.checks()
