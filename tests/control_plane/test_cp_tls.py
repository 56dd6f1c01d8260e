"""TLS on both of the control plane's TCP ports: the admin API (HTTPS) and xDS (gRPC over TLS),
checked with real certificates (trustme) and clients that verify them, Envoy included."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio
import trustme
import yaml
from aiohttp.test_utils import TestServer
from conftest import bearer, free_port, make_settings, new_tokens
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from pydantic import ValidationError
from test_envoy_bootstrap import envoy_accepts, needs_envoy
from test_envoy_xds import (  # noqa: F401 (fixtures)
    LiveControlPlane,
    cp,
    send,
    start_envoy,
    upstreams,
)
from test_xds_plan import add_node, add_region
from test_xds_server import FakeEnvoy, ingress_token, xds_server

from control_plane.changes import ChangeFeed
from control_plane.model import Fleet
from control_plane.settings import Settings
from control_plane.store import open_store
from control_plane.tokens import TokenSet
from control_plane.xds import bootstrap
from control_plane.xds.server import ServerTls, XdsServer
from gateway.app import create_app as create_gateway
from gateway.settings import GatewaySettings
from node_agent.heartbeat import control_plane_client
from node_agent.settings import NodeAgentSettings

MAX_WAIT_S = 20.0


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def cert_files(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    root = tmp_path_factory.mktemp("tls")
    cert_path, key_path = root / "cp.pem", root / "cp.key"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    return cert_path, key_path


@pytest.fixture(scope="module")
def ca_file(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


@pytest.mark.slow
def test_admin_api_and_xds_serve_tls_to_clients_that_verify(
    start_process: Any, tmp_path: Path, cert_files: tuple[Path, Path], ca_file: Path
) -> None:
    tokens = new_tokens()
    xds_port = free_port()
    args = ["--db", str(tmp_path / "cp.db"), "--xds-port", str(xds_port)]
    args += ["--tls-cert", str(cert_files[0]), "--tls-key", str(cert_files[1])]
    env = {"MERIDIAN_ADMIN_TOKEN": tokens.admin, "MERIDIAN_GATEWAY_TOKEN": tokens.gateway}
    process = start_process(args, env, ca_file=ca_file)
    assert process.base_url.startswith("https://")

    verifying = ssl.create_default_context(cafile=str(ca_file))
    with httpx.Client(base_url=process.base_url, verify=verifying, timeout=10.0) as http:
        assert http.get("/v1/status", headers=bearer(tokens.admin)).status_code == 200
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(process.base_url + "/openapi.json", timeout=10.0)  # the system CAs only
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{process.port}/openapi.json", timeout=10.0)

    # xDS: a gRPC client trusting the CA completes the TLS handshake; a plaintext one cannot.
    address = f"127.0.0.1:{xds_port}"
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes())
    with grpc.secure_channel(address, credentials) as channel:
        grpc.channel_ready_future(channel).result(timeout=MAX_WAIT_S)
    with grpc.insecure_channel(address) as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.StreamAggregatedResources(iter([discovery_pb2.DiscoveryRequest()])))
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def test_settings_want_both_tls_files_and_existing_ones(
    tmp_path: Path, cert_files: tuple[Path, Path]
) -> None:
    tokens = new_tokens()
    with pytest.raises(ValidationError, match="both --tls-cert and --tls-key"):
        make_settings(tmp_path / "cp.db", tokens, tls_cert=cert_files[0])
    with pytest.raises(ValidationError, match="no such file"):
        make_settings(
            tmp_path / "cp.db", tokens, tls_cert=tmp_path / "absent.pem", tls_key=cert_files[1]
        )


@pytest_asyncio.fixture
async def tls_xds(cert_files: tuple[Path, Path]) -> AsyncIterator[tuple[XdsServer, str]]:
    """An ADS server on TLS, and an xDS token for its us-east ingress."""
    fleet = Fleet(unhealthy_after_s=60.0)
    add_region(fleet, "us-east")
    add_node(fleet, "a", port=9001, kv_blocks_free=300)
    feed = ChangeFeed(1)
    store = open_store(":memory:")
    xds = xds_server(fleet, feed, store)
    tls = ServerTls(cert_files[0].read_bytes(), cert_files[1].read_bytes())
    await xds.start("127.0.0.1", 0, tls)
    try:
        yield xds, await ingress_token(store)
    finally:
        await xds.stop()
        feed.close()
        store.close()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_xds_over_tls_speaks_ads(tls_xds: tuple[XdsServer, str], ca_file: Path) -> None:
    xds, token = tls_xds
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{xds.port}", credentials) as channel:
        envoy = FakeEnvoy(channel, token)
        envoy.open()
        first = await envoy.subscribe_all()
        assert len(first) == 4
        assert xds.counters.num_acks["endpoints"] == 1


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet, cert_files: tuple[Path, Path]) -> Settings:
    """For the `cp` fixture of test_envoy_xds: its xDS port speaks TLS."""
    return make_settings(tmp_path / "cp.db", tokens, tls_cert=cert_files[0], tls_key=cert_files[1])


@pytest.mark.slow
@needs_envoy
def test_bootstrap_with_a_ca_points_envoy_at_a_tls_xds(
    tmp_path: Path, ca_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--region", "us-east", "--listen", "127.0.0.1:10000", "--xds", "cp.example:18000"]
    monkeypatch.setenv(bootstrap.TOKEN_ENV, "mxds-" + "t" * 40)
    config = bootstrap.config_of(bootstrap.parse_args([*argv, "--xds-ca", str(ca_file)]))
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap.dump(config))
    envoy_accepts(path)
    (cluster,) = yaml.safe_load(path.read_text())["static_resources"]["clusters"]
    context = cluster["transport_socket"]["typed_config"]
    assert context["sni"] == "cp.example"
    validation = context["common_tls_context"]["validation_context"]
    assert validation["trusted_ca"] == {"filename": str(ca_file)}
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "cp.example"}}
    ]
    with pytest.raises(ValueError, match="no such file"):
        bootstrap.config_of(bootstrap.parse_args([*argv, "--xds-ca", str(tmp_path / "x.pem")]))


@needs_envoy
@pytest.mark.slow
@pytest.mark.asyncio
async def test_envoy_takes_its_config_from_a_tls_xds(
    cp: LiveControlPlane,  # noqa: F811
    upstreams: Any,  # noqa: F811
    start_envoy: Any,  # noqa: F811
    ca_file: Path,
) -> None:
    (a,) = await upstreams("a")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    await cp.beat("a", url=a.url, kv_blocks_free=300)
    envoy = await start_envoy(
        cp.xds_address, "--region", "us-east", "--xds-ca", str(ca_file), token=await cp.xds_token()
    )
    answers = await send(envoy.url, 20)
    assert answers == {"a": 20}, answers


@pytest.mark.slow
@pytest.mark.asyncio
async def test_gateways_and_node_agents_verify_a_tls_control_plane_by_its_ca(
    start_process: Any,
    tmp_path: Path,
    cert_files: tuple[Path, Path],
    ca_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = new_tokens()
    args = ["--db", str(tmp_path / "cp.db"), "--xds-port", str(free_port())]
    args += ["--tls-cert", str(cert_files[0]), "--tls-key", str(cert_files[1])]
    env = {"MERIDIAN_ADMIN_TOKEN": tokens.admin, "MERIDIAN_GATEWAY_TOKEN": tokens.gateway}
    process = start_process(args, env, ca_file=ca_file)

    gateway_settings = GatewaySettings(
        pop="new-york",
        control_plane=process.base_url,
        control_plane_ca=ca_file,
        gateway_token=tokens.gateway,
        tls_mode="plain",
    )
    server = TestServer(create_gateway(gateway_settings))
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url(""))) as client:
            health = await client.get("/health")
    finally:
        await server.close()
    assert health.status_code == 200, health.text  # keys and regions loaded over verified TLS

    monkeypatch.setenv("MERIDIAN_NODE_TOKEN", "n" * 32)
    trusting = NodeAgentSettings(control_plane=process.base_url, control_plane_ca=ca_file)
    async with control_plane_client(trusting) as client:
        assert (await client.get(process.base_url + "/v1/status")).status_code == 401
    default = NodeAgentSettings(control_plane=process.base_url)
    async with control_plane_client(default) as client:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await client.get(process.base_url + "/v1/status")
