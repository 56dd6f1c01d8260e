"""One error contract: every hop answers the same error in the same OpenAI shape.

The three services are real apps served in-process (no engine, no fleet): what they say about a
path they have no route for, or a wrong method, must not depend on which hop said it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from pydantic import SecretStr

from control_plane.app import create_app as create_control_plane
from control_plane.settings import Settings as ControlPlaneSettings
from gateway.app import HANDLERS
from gateway.app import create_app as create_gateway
from gateway.settings import GatewaySettings
from node_agent.app import create_app as create_node_agent
from node_agent.settings import NodeAgentSettings
from wire.errors import STATUS_MAP, error_body
from wire.key_snapshot import KeySnapshot

# (method, path, status, code): an unknown path, and a known one with a wrong method.
OPENAI_ROUTE_ERRORS = [
    ("GET", "/v1/nope", 404, "route_not_found"),
    ("DELETE", "/v1/chat/completions", 405, "method_not_allowed"),
]
ADMIN_ROUTE_ERRORS = [
    ("GET", "/v1/nope", 404, "route_not_found"),
    ("DELETE", "/v1/status", 405, "method_not_allowed"),
]
MESSAGES = {404: "Invalid URL ({} {})", 405: "Method not allowed ({} {})"}
Answers = list[tuple[int, object]]


def _expected(errors: list[tuple[str, str, int, str]]) -> Answers:
    return [
        (status, error_body(status, MESSAGES[status].format(method, path), code))
        for method, path, status, code in errors
    ]


async def _answers(client: httpx.AsyncClient, errors: list[tuple[str, str, int, str]]) -> Answers:
    return [
        (response.status_code, response.json())
        for method, path, *_ in errors
        for response in [await client.request(method, path)]
    ]


def test_every_status_in_the_map_has_a_distinct_default_code() -> None:
    codes = [code for _, code in STATUS_MAP.values()]
    assert len(codes) == len(set(codes))


def test_the_type_follows_from_the_status_alone() -> None:
    assert error_body(404, "x", "model_not_found")["error"] == {
        "message": "x",
        "type": "not_found_error",
        "param": None,
        "code": "model_not_found",
    }
    assert error_body(418, "teapot")["error"] == {
        "message": "teapot",
        "type": "invalid_request_error",
        "param": None,
        "code": "http_error",
    }
    assert error_body(599, "odd")["error"]["type"] == "server_error"


def _asgi_client(app: object) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://asgi")


async def _asgi_answers(app: object, errors: list[tuple[str, str, int, str]]) -> Answers:
    async with _asgi_client(app) as client:
        return await _answers(client, errors)


@pytest_asyncio.fixture
async def gateway_client(
    unused_tcp_port: int, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    """A real gateway, with an empty key table loaded (every key is unknown to it). No control
    plane listens at its address: it starts anyway (serving 503s) after waiting for one, which
    is all an error before any upstream needs."""
    monkeypatch.setattr("gateway.app.FIRST_LOAD_WAIT_S", 0.1)
    settings = GatewaySettings(
        pop="new-york",
        control_plane=f"http://127.0.0.1:{unused_tcp_port}",
        gateway_token="g" * 32,
        tls_mode="plain",
    )
    app = create_gateway(settings)
    app[HANDLERS].keys.replace(KeySnapshot(index=1, keys=[]))
    server = TestServer(app)
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url(""))) as client:
            yield client
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_route_errors_read_the_same_at_every_hop(
    tmp_path: Path, gateway_client: httpx.AsyncClient
) -> None:
    node_agent = create_node_agent(NodeAgentSettings(model="unused"))
    assert await _asgi_answers(node_agent, OPENAI_ROUTE_ERRORS) == _expected(OPENAI_ROUTE_ERRORS)

    control_plane = create_control_plane(ControlPlaneSettings(db_path=str(tmp_path / "fleet.db")))
    assert await _asgi_answers(control_plane, ADMIN_ROUTE_ERRORS) == _expected(ADMIN_ROUTE_ERRORS)

    answers = await _answers(gateway_client, OPENAI_ROUTE_ERRORS)
    assert answers == _expected(OPENAI_ROUTE_ERRORS)


# (Authorization header or None, the 401's code): the same two codes at every hop.
CREDENTIAL_ERRORS = [
    (None, "missing_api_key"),
    ("", "missing_api_key"),
    ("Bearer not-a-credential", "invalid_api_key"),
    ("Bearer", "invalid_api_key"),
    ("Basic dXNlcjpwYXNz", "invalid_api_key"),
]


async def _credential_codes(client: httpx.AsyncClient, method: str, path: str) -> list[str]:
    codes = []
    for authorization, _ in CREDENTIAL_ERRORS:
        headers = {} if authorization is None else {"Authorization": authorization}
        response = await client.request(method, path, headers=headers, json={})
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["type"] == "authentication_error"
        codes.append(error["code"])
    return codes


@pytest.mark.asyncio
async def test_a_missing_and_a_bad_credential_have_one_code_each_at_every_hop(
    tmp_path: Path, gateway_client: httpx.AsyncClient
) -> None:
    expected = [code for _, code in CREDENTIAL_ERRORS]
    assert await _credential_codes(gateway_client, "POST", "/v1/chat/completions") == expected

    token = SecretStr("serving-token-0123456789abcdef")
    node_agent = create_node_agent(NodeAgentSettings(model="unused", serving_token=token))
    async with _asgi_client(node_agent) as client:
        assert await _credential_codes(client, "POST", "/v1/chat/completions") == expected

    control_plane = create_control_plane(ControlPlaneSettings(db_path=str(tmp_path / "fleet.db")))
    async with (
        control_plane.router.lifespan_context(control_plane),
        _asgi_client(control_plane) as client,
    ):
        assert await _credential_codes(client, "GET", "/v1/status") == expected
