"""A grammar the model's vocabulary cannot spell ends its request with a 400 `grammar_error`
(whole, or as the stream's error event), and the node serves on. A real node agent over a real
engine core process with a tiny model whose vocabulary is printable ASCII only."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from node_helpers import BackgroundLoop, NodeHandle, start_engine, start_node
from tiny_checkpoints import save_tiny_transformers_model

pytestmark = pytest.mark.slow

SERVED_NAME = "tiny-llama"
UNSPELLABLE = {"guided_choice": ["\u00b0", "\u00e9t\u00e9"]}  # no token holds these bytes


@pytest.fixture(scope="module")
def tiny_node(
    tmp_path_factory: pytest.TempPathFactory, server_loop: BackgroundLoop
) -> Iterator[NodeHandle]:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny_transformers_model(folder, "llama")
    llm = start_engine(server_loop, folder, dtype="float32", num_kv_blocks=64, max_model_len=128)
    node = start_node(server_loop, llm, model=str(folder), served_model_name=SERVED_NAME)
    yield node
    node.stop()
    server_loop.run(llm.shutdown())


@pytest.fixture
def http(tiny_node: NodeHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_node.base_url, timeout=60) as client:
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
