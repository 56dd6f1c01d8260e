"""The gateway's metrics: on a listener of their own (loopback by default, behind a token when
one is set), never on the public port, and by API key only when the operator asks, since a
label per key lists the tenants and their volume to whoever can scrape."""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gw_fleet import Fleet, GatewayThread
from pydantic import ValidationError

from gateway.__main__ import main
from gateway.settings import GatewaySettings

CHAT = {"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
METRICS_TOKEN = "metrics-" + "m" * 24


def _client(gateway: GatewayThread, client_ssl: ssl.SSLContext, secret: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {secret}"}
    return httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers)


def _serve_and_refuse_one(
    two_regions: Fleet, gateway: GatewayThread, client_ssl: ssl.SSLContext
) -> str:
    """One request answered and one refused by the key's limit; returns the key's id."""
    key_id, secret = two_regions.create_key(rpm=1)
    with _client(gateway, client_ssl, secret) as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 429
    return key_id


def test_the_public_port_has_no_metrics_and_the_metrics_listener_has_nothing_else(
    gateway: GatewayThread, http: httpx.Client
) -> None:
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    public = http.get("/metrics")  # even with a valid API key
    assert public.status_code == 404
    assert public.json()["error"]["code"] == "route_not_found"
    scraped = httpx.get(gateway.metrics_url)
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    assert 'meridian_gateway_requests_total{region="us-east",status="200"} 1.0' in scraped.text
    assert gateway.metrics_url.startswith("http://127.0.0.1:")
    other = httpx.get(gateway.metrics_url.removesuffix("/metrics") + "/health")
    assert other.status_code == 404 and other.json()["error"]["code"] == "route_not_found"


def test_counts_carry_no_key_id_unless_the_operator_asks(
    two_regions: Fleet, gateway: GatewayThread, client_ssl: ssl.SSLContext
) -> None:
    key_id = _serve_and_refuse_one(two_regions, gateway, client_ssl)
    metrics = httpx.get(gateway.metrics_url).text
    assert "key_id" not in metrics and key_id not in metrics
    assert 'meridian_gateway_requests_total{region="us-east",status="200"} 1.0' in metrics
    assert 'meridian_gateway_requests_total{region="none",status="429"} 1.0' in metrics
    assert 'meridian_gateway_rate_limited_total{limit="requests"} 1.0' in metrics

    labelled = two_regions.start_gateway(metrics_key_labels=True)
    two_regions.wait_for_gateway(labelled)
    key_id = _serve_and_refuse_one(two_regions, labelled, client_ssl)
    metrics = httpx.get(labelled.metrics_url).text
    served = f'meridian_gateway_requests_total{{key_id="{key_id}",region="us-east",status="200"}}'
    assert served + " 1.0" in metrics
    assert f'meridian_gateway_rate_limited_total{{key_id="{key_id}",limit="requests"}} 1.0' in (
        metrics
    )


def test_with_a_metrics_token_a_scrape_must_send_it(two_regions: Fleet) -> None:
    gateway = two_regions.start_gateway(metrics_token=METRICS_TOKEN)
    missing = httpx.get(gateway.metrics_url)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    for wrong in ("Bearer " + METRICS_TOKEN[:-1] + "x", "Basic " + METRICS_TOKEN, METRICS_TOKEN):
        refused = httpx.get(gateway.metrics_url, headers={"Authorization": wrong})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    right = httpx.get(gateway.metrics_url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert right.status_code == 200 and "meridian_gateway_info" in right.text


def test_metrics_off_loopback_need_a_token() -> None:
    values: dict[str, Any] = {
        "pop": "new-york",
        "control_plane": "http://127.0.0.1:1",
        "gateway_token": "g" * 32,
        "metrics_host": "0.0.0.0",
    }
    with pytest.raises(ValidationError, match="MERIDIAN_GATEWAY_METRICS_TOKEN"):
        GatewaySettings(**values)
    settings = GatewaySettings(**(values | {"metrics_token": METRICS_TOKEN}))
    assert settings.metrics_host == "0.0.0.0"
    assert GatewaySettings(**(values | {"metrics_host": "::1"})).metrics_port == 9464


@pytest.fixture
def root_logging() -> Iterator[None]:
    """`main` points the root logger at this test's captured stderr; later tests must not log
    into that closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_logging")
def test_a_taken_metrics_port_fails_the_start_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", "g" * 32)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--pop", "new-york", "--control-plane", "http://127.0.0.1:1", "--plain"]
        status = main([*args, "--port", "0", "--metrics-port", str(port)])
    err = capsys.readouterr().err
    assert status == 1
    assert err == (
        f"gateway: error: cannot listen on 127.0.0.1:{port} for metrics: Address already in use\n"
    )
