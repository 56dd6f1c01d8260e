"""The node's `X-Request-Id`: a caller's id is echoed only when it is safe to put in a header and a
log line ([A-Za-z0-9._:-], at most 128), else the node mints its own. A real uvicorn server on
127.0.0.1 over the node agent's app, without a model (the id is set before any route runs)."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import plain_http
import pytest
import uvicorn
from node_helpers import BackgroundLoop, wait_until

from node_agent.app import create_app
from node_agent.settings import NodeAgentSettings

MINTED = re.compile(r"[0-9a-f]{32}")
SAFE_IDS = ["req-1.2:abc_DEF", "0" * 128, "550e8400-e29b-41d4-a716-446655440000"]
UNSAFE_IDS: list[bytes] = [
    b'a"b<script>',
    b"x" * 129,
    b"a b",
    b"caf\xc3\xa9",
    b"a/b",
    b"id;drop",
    b"a\\nb",
]


@pytest.fixture(scope="module")
def node_url(server_loop: BackgroundLoop) -> Iterator[str]:
    app = create_app(NodeAgentSettings(model="unused", node_id="n1", region="us-east"))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    done = server_loop.submit(server.serve(sockets=[sock]))
    assert wait_until(lambda: server.started, timeout_s=10.0)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    done.result(15)
    sock.close()


def answered_id(node_url: str, given: bytes) -> str:
    with plain_http.client(base_url=node_url) as http:
        response = http.get("/v1/nope", headers={"x-request-id": given})
    assert response.status_code == 404
    assert response.headers["x-meridian-node"] == "n1"
    return response.headers["x-request-id"]


@pytest.mark.parametrize("given", SAFE_IDS)
def test_a_safe_request_id_is_echoed(node_url: str, given: str) -> None:
    assert answered_id(node_url, given.encode()) == given


@pytest.mark.parametrize("given", UNSAFE_IDS)
def test_an_unsafe_request_id_is_replaced(node_url: str, given: bytes) -> None:
    assert MINTED.fullmatch(answered_id(node_url, given))
