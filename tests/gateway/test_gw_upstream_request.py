"""The upstream body as data: one encoding on the wire, and the gateway's edits of it (the edge's
model, a prewarm's cut) made on its fields."""

from __future__ import annotations

import json

from gateway.edge import _with_model
from gateway.openai_request import parse_request
from gateway.prewarm import prewarm_of
from gateway.request_ids import HEADER as REQUEST_ID_HEADER
from gateway.upstream_request import UpstreamBody, UpstreamRequest, encode

CHAT = {
    "model": "auto",
    "messages": [{"role": "user", "content": "héllo ☃ \U0001f600"}],
    "max_completion_tokens": 9,
    "stream": True,
}


def upstream(body: dict[str, object]) -> UpstreamRequest:
    parsed = parse_request(json.dumps(body).encode(), "chat", 256)
    headers = {REQUEST_ID_HEADER: "req-1"}
    return UpstreamRequest("POST", "/v1/chat/completions", parsed.upstream_body, headers, True)


def test_the_body_goes_compact_with_text_as_utf8_in_the_clients_order() -> None:
    fields = {"z": "é", "a": [1, {"b": None}]}
    assert encode(fields) == '{"z":"é","a":[1,{"b":null}]}'.encode()
    assert UpstreamBody.of(fields, 5).encoded == encode(fields)


def test_the_edge_gets_the_same_bytes_but_its_model() -> None:
    request = upstream(CHAT)
    assert request.body is not None
    to_edge = _with_model(request, "edge-model")
    assert to_edge.body is not None and to_edge.max_tokens == request.max_tokens == 9
    expected = request.body.encoded.replace(b'"model":"auto"', b'"model":"edge-model"')
    assert to_edge.body.encoded == expected
    assert "héllo ☃ \U0001f600".encode() in to_edge.body.encoded  # text as sent, unescaped


def test_a_prewarm_is_the_request_cut_to_one_token_and_not_streamed() -> None:
    request = upstream(CHAT)
    warm = prewarm_of(request)
    assert warm is not None and warm.body is not None
    assert not warm.is_stream and warm.max_tokens == 1
    assert warm.headers[REQUEST_ID_HEADER] == "req-1-prewarm"
    assert request.body is not None
    expected = dict(request.body.fields)
    del expected["stream_options"]
    expected |= {"stream": False, "max_tokens": 1, "max_completion_tokens": 1}
    assert json.loads(warm.body.encoded) == expected
    assert request.body.fields["stream"] is True  # the original is left as it was


def test_a_request_without_a_body_sends_none() -> None:
    request = UpstreamRequest("GET", "/v1/models", None, {}, False)
    assert request.data is None and request.max_tokens == 0
