"""One error contract: every hop answers the same error in the same OpenAI shape.

The three services are real apps served in-process (no engine, no fleet): what they say about a
path they have no route for, or a wrong method, must not depend on which hop said it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import TestServer

from control_plane.app import create_app as create_control_plane
from control_plane.settings import Settings as ControlPlaneSettings
from gateway.app import create_app as create_gateway
from gateway.settings import GatewaySettings
from node_agent.app import create_app as create_node_agent
from node_agent.settings import NodeAgentSettings
from wire.errors import STATUS_MAP, error_body

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


async def _asgi_answers(app: object, errors: list[tuple[str, str, int, str]]) -> Answers:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://asgi") as client:
        return await _answers(client, errors)


@pytest.mark.asyncio
async def test_route_errors_read_the_same_at_every_hop(
    tmp_path: Path, unused_tcp_port: int
) -> None:
    node_agent = create_node_agent(NodeAgentSettings(model="unused"))
    assert await _asgi_answers(node_agent, OPENAI_ROUTE_ERRORS) == _expected(OPENAI_ROUTE_ERRORS)

    control_plane = create_control_plane(ControlPlaneSettings(db_path=str(tmp_path / "fleet.db")))
    assert await _asgi_answers(control_plane, ADMIN_ROUTE_ERRORS) == _expected(ADMIN_ROUTE_ERRORS)

    # No control plane listens there: the gateway starts anyway (serving 503s) after waiting for
    # one, which is all a route error needs.
    settings = GatewaySettings(
        pop="new-york",
        control_plane=f"http://127.0.0.1:{unused_tcp_port}",
        gateway_token="g" * 32,
        tls_mode="plain",
    )
    server = TestServer(create_gateway(settings))
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url(""))) as client:
            answers = await _answers(client, OPENAI_ROUTE_ERRORS)
    finally:
        await server.close()
    assert answers == _expected(OPENAI_ROUTE_ERRORS)
