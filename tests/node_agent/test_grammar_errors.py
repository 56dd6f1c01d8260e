"""Grammars the model's vocabulary cannot spell, at a real node agent over a real engine core
process with a tiny model whose vocabulary is printable ASCII only: one that no token can start
is refused up front (a 400 naming its field, a stream too: no response starts, nothing is
queued); one that runs into a dead end on the way ends its request with a 400 `grammar_error`
(whole, or as the stream's error event). The node serves on after both."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from node_helpers import TINY_SERVED_NAME, BackgroundLoop, NodeHandle, tiny_node

pytestmark = pytest.mark.slow

SERVED_NAME = TINY_SERVED_NAME
BODY = {"model": SERVED_NAME, "prompt": "ab", "max_tokens": 4}
UNSPELLABLE = {"guided_choice": ["\u00b0", "\u00e9t\u00e9"]}  # no token holds these bytes
DEAD_END = {"guided_choice": ["x\u00b0"]}  # "x" is a token; nothing spells what follows


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


def served_on(http: httpx.Client) -> bool:
    ok = http.post("/v1/completions", json={**BODY, "guided_choice": ["xy"]})
    return ok.status_code == 200 and ok.json()["choices"][0]["text"] == "xy"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (UNSPELLABLE, "guided_choice"),
        ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"),  # matches nothing
    ],
)
def test_a_grammar_no_token_can_start_is_refused_before_anything_runs(
    http: httpx.Client, node: NodeHandle, fields: dict[str, object], param: str
) -> None:
    for stream in (False, True):
        response = http.post("/v1/completions", json={**BODY, **fields, "stream": stream})
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert error["param"] == param, error
        assert "no output of it can be spelled" in error["message"], error
    assert served_on(http)


def test_a_grammar_that_runs_into_a_dead_end_is_400_grammar_error(http: httpx.Client) -> None:
    body = {**BODY, **DEAD_END}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "grammar_error"
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert json.loads(events[-1][6:])["error"]["code"] == "grammar_error"
    assert served_on(http)
