"""How `meridian up` knows each part of the stack is ready: probes, each a `() -> bool` that
never raises (a part that does not answer yet is simply not ready)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import httpx

from stack.layout import PopLayout, StackLayout

PROBE_TIMEOUT_S: Final = 2.0

Probe = Callable[[], bool]


def port_is_open(port: int) -> Probe:
    """A TCP listener on 127.0.0.1:`port` (redis-server, which speaks no HTTP)."""

    def probe() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
        except OSError:
            return False
        return True

    return probe


def postgres_accepts(url: str) -> Probe:
    """A PostgreSQL that takes a connection at `url`."""
    import psycopg  # the `postgres` extra, only here: find_postgres has checked it is there

    def probe() -> bool:
        try:
            psycopg.connect(url, connect_timeout=1).close()
        except psycopg.Error:
            return False
        return True

    return probe


class HttpProbes:
    """The HTTP probes, with a client of their own for plain HTTP and one for the gateways'
    HTTPS (trusting the stack's CA); the control plane's carry the admin token."""

    def __init__(self, layout: StackLayout, admin_token: str, ca_cert: Path) -> None:
        self.layout = layout
        self.admin_headers = {"Authorization": f"Bearer {admin_token}"}
        self.http = httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False)
        self.gateway_http = httpx.Client(
            timeout=PROBE_TIMEOUT_S,
            verify=ssl.create_default_context(cafile=str(ca_cert)),
            trust_env=False,
        )

    def close(self) -> None:
        self.http.close()
        self.gateway_http.close()

    def _get(self, url: str, client: httpx.Client, **kwargs: Any) -> httpx.Response | None:
        try:
            return client.get(url, **kwargs)
        except httpx.HTTPError:
            return None

    def _is_ok(self, url: str, client: httpx.Client, **kwargs: Any) -> bool:
        response = self._get(url, client, **kwargs)
        return response is not None and response.status_code == 200

    def ok(self, url: str) -> Probe:
        """`url` answers 200."""
        return lambda: self._is_ok(url, self.http)

    def ok_as_admin(self, url: str) -> Probe:
        """`url` answers 200 to the admin token."""
        return lambda: self._is_ok(url, self.http, headers=self.admin_headers)

    def _control_plane_get(self, path: str) -> httpx.Response | None:
        """The admin answer of the first replica that gives one (as clients fail over)."""
        for replica in self.layout.control_planes:
            response = self._get(replica.url + path, self.http, headers=self.admin_headers)
            if response is not None and response.status_code < 500:
                return response
        return None

    def node_is_ready(self, node_id: str, url: str) -> Probe:
        """The node agent says it is ready, and the control plane has seen its heartbeat."""

        def probe() -> bool:
            if not self._is_ok(url + "/ready", self.http):
                return False
            seen = self._control_plane_get(f"/v1/nodes/{node_id}")
            return seen is not None and seen.status_code == 200 and seen.json()["is_healthy"]

        return probe

    def gateway_is_ready(self, pop: PopLayout) -> Probe:
        """The PoP's gateway is healthy and sees every node of every region healthy."""

        def probe() -> bool:
            response = self._get(pop.url + "/health", self.gateway_http)
            if response is None or response.status_code != 200:
                return False
            regions = response.json().get("regions", {})
            return all(
                regions.get(region.name, {}).get("healthy_nodes", 0) >= len(region.nodes)
                for region in self.layout.regions
            )

        return probe

    def key_is_accepted(self, pop: PopLayout, api_key: str) -> Probe:
        """The PoP's gateway accepts `api_key` (it has reached the gateway's key cache)."""
        headers = {"Authorization": f"Bearer {api_key}"}
        return lambda: self._is_ok(f"{pop.url}/v1/models", self.gateway_http, headers=headers)
