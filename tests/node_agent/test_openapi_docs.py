"""The node agent's /openapi.json describes every field of its request bodies, the agent API's
(response_format, tools, tool_choice, n, penalties, logit_bias, min_tokens, stop_token_ids,
guided_*) and those of every object they hold (node_agent/request_docs.py)."""

from __future__ import annotations

import asyncio

import httpx

from node_agent.app import create_app
from node_agent.settings import NodeAgentSettings

JSON = dict[str, object]
REF = "#/components/schemas/"
AGENT_FIELDS = (
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "guided_regex",
    "guided_choice",
    "seed",
)


def openapi() -> JSON:
    """The schema as the node serves it (its lifespan, which loads a model, not started)."""
    app = create_app(NodeAgentSettings(model="any"))

    async def get() -> JSON:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            response = await client.get("/openapi.json")
            assert response.status_code == 200
            schema: JSON = response.json()
            return schema

    return asyncio.run(get())


def refs_in(value: object) -> list[str]:
    if isinstance(value, dict):
        ref = value.get("$ref")
        own = [ref.removeprefix(REF)] if isinstance(ref, str) else []
        return own + [r for v in value.values() for r in refs_in(v)]
    if isinstance(value, list):
        return [r for v in value for r in refs_in(v)]
    return []


def request_schemas(schema: JSON) -> dict[str, JSON]:
    """Every component schema a completion endpoint's request body reaches."""
    components = schema["components"]["schemas"]  # type: ignore[index]
    paths = schema["paths"]
    bodies = [paths[p]["post"]["requestBody"] for p in ("/v1/chat/completions", "/v1/completions")]  # type: ignore[index]
    pending, reached = refs_in(bodies), {}
    while pending:
        name = pending.pop()
        if name not in reached:
            reached[name] = components[name]
            pending += refs_in(components[name])
    return reached


def test_every_request_field_has_a_description() -> None:
    schemas = request_schemas(openapi())
    assert {"ChatCompletionRequest", "CompletionRequest", "ResponseFormat", "ToolDefinition"} <= (
        set(schemas)
    )
    undescribed = [
        f"{name}.{field}"
        for name, schema in schemas.items()
        for field, spec in (schema.get("properties") or {}).items()  # type: ignore[attr-defined]
        if not spec.get("description")
    ]
    assert undescribed == []
    chat = schemas["ChatCompletionRequest"]["properties"]
    for field in AGENT_FIELDS:
        assert chat[field]["description"], field  # type: ignore[index]
