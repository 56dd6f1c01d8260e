"""A grammar the model's vocabulary cannot spell ends its request with a 400 `grammar_error`
(whole, or as the stream's error event), and the node serves on. A real node agent over a real
engine core process with a tiny model whose vocabulary is printable ASCII only."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from node_helpers import TINY_SERVED_NAME, BackgroundLoop, NodeHandle, tiny_node

pytestmark = pytest.mark.slow

SERVED_NAME = TINY_SERVED_NAME
UNSPELLABLE = {"guided_choice": ["\u00b0", "\u00e9t\u00e9"]}  # no token holds these bytes


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, server_loop: BackgroundLoop
) -> Iterator[NodeHandle]:
    with tiny_node(server_loop, tmp_path_factory.mktemp("tiny") / "model") as handle:
        yield handle


@pytest.fixture
def http(node: NodeHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.base_url, timeout=60) as client:
        yield client


def test_an_unspellable_choice_is_400_grammar_error_and_the_node_serves_on(
    http: httpx.Client,
) -> None:
    body = {"model": SERVED_NAME, "prompt": "ab", "max_tokens": 4, **UNSPELLABLE}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "grammar_error"
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert json.loads(events[-1][6:])["error"]["code"] == "grammar_error"
    ok = http.post(
        "/v1/completions",
        json={"model": SERVED_NAME, "prompt": "ab", "max_tokens": 4, "guided_choice": ["xy"]},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "xy"
