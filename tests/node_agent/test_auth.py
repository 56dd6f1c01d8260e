"""The serving token: with one set, the OpenAI API answers only its bearer (401 otherwise, in
OpenAI's error shape, before the body is read); probes and metrics stay open."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from node_helpers import MODEL_NAME, BackgroundLoop, NodeHandle, start_node

SERVING_TOKEN = "srv-token-for-tests-0123456789"
CHAT_BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def guarded(server_loop: BackgroundLoop, fake_llm: FakeEngine) -> Iterator[NodeHandle]:
    handle = start_node(server_loop, fake_llm, serving_token=SERVING_TOKEN)
    yield handle
    handle.stop()


def assert_401(response: httpx.Response, code: str = "invalid_api_key") -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == code
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers["x-request-id"]  # refusals can be traced like any answer
    assert SERVING_TOKEN not in response.text


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-0123456789"},
        {"Authorization": f"Bearer {SERVING_TOKEN}x"},
        {"Authorization": f"Basic {SERVING_TOKEN}"},
        {"Authorization": SERVING_TOKEN},
    ],
    ids=["none", "wrong", "longer", "basic", "no-scheme"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL_NAME}"),
        ("GET", "/v1/no-such-route"),
    ],
)
def test_every_v1_route_refuses_a_missing_or_wrong_token_with_401(
    guarded: NodeHandle, headers: dict[str, str], method: str, path: str
) -> None:
    before = guarded.stats().prompt_tokens_total
    with guarded.client() as http:
        code = "invalid_api_key" if headers else "missing_api_key"
        assert_401(http.request(method, path, headers=headers, json=CHAT_BODY), code)
    assert guarded.stats().prompt_tokens_total == before


def test_a_malformed_body_without_the_token_is_still_401(guarded: NodeHandle) -> None:
    with guarded.client() as http:
        response = http.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        )
    assert_401(response, "missing_api_key")


def test_the_official_client_with_the_token_is_served(guarded: NodeHandle) -> None:
    with openai.OpenAI(
        base_url=guarded.base_url + "/v1", api_key=SERVING_TOKEN, max_retries=0
    ) as client:
        assert [m.id for m in client.models.list()] == [MODEL_NAME]
        reply = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens == 2
    with (
        openai.OpenAI(
            base_url=guarded.base_url + "/v1", api_key="not-the-token", max_retries=0
        ) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_health_ready_and_metrics_stay_open(guarded: NodeHandle) -> None:
    with guarded.client() as http:
        for path in ("/health", "/ready", "/metrics"):
            assert http.get(path).status_code == 200, path


def test_without_a_token_a_loopback_node_serves_anyone(node: NodeHandle) -> None:
    with node.client() as http:
        assert http.get("/v1/models").status_code == 200
