"""Fixtures for the gateway: a trusted test CA and server certificate, and a fleet (real control
plane, fake regions behind delaying forwarders, real gateways) per test."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from gw_fleet import Fleet, GatewayThread, wait_until
from suite_env import clear_settings


@pytest.fixture(autouse=True)
def no_meridian_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests decide every setting themselves: ignore MERIDIAN_* from the calling shell (but the
    suite's pins, tests/suite_env.py)."""
    clear_settings(monkeypatch)


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def server_cert(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost signed by the test CA, as files."""
    directory = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1", "localhost", "::1")
    cert_path, key_path = directory / "gateway.pem", directory / "gateway.key"
    cert.private_key_pem.write_to_path(str(key_path))
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return cert_path, key_path


@pytest.fixture(scope="session")
def client_ssl(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


@pytest.fixture
def fleet(tmp_path: Path, server_cert: tuple[Path, Path]) -> Iterator[Fleet]:
    """A control plane with no regions yet; add regions and gateways in the test."""
    fleet = Fleet(tmp_path, server_cert)
    try:
        fleet.start_control_plane()
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def two_regions(fleet: Fleet) -> Fleet:
    """us-east (about 5 ms from the New York PoP) and eu-west (about 55 ms)."""
    fleet.add_region("us-east")
    fleet.add_region("eu-west")
    return fleet


@pytest.fixture
def gateway(two_regions: Fleet) -> GatewayThread:
    gateway = two_regions.start_gateway()
    two_regions.wait_for_gateway(gateway)
    return gateway


@pytest.fixture
def api_key(two_regions: Fleet) -> str:
    return two_regions.create_key()[1]


@pytest.fixture
def http(
    gateway: GatewayThread, client_ssl: ssl.SSLContext, api_key: str
) -> Iterator[httpx.Client]:
    """An httpx client to the gateway, verifying its certificate, with a valid key."""
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(
        base_url=gateway.base_url, verify=client_ssl, headers=headers, timeout=30.0
    ) as client:
        # The key was created after the gateway started: wait for its snapshot.
        gateway_keys = gateway.handlers.keys
        wait_until(lambda: len(gateway_keys) > 0, 5.0, "the key snapshot")
        yield client
