"""The API fuzzed from its own OpenAPI schema (schemathesis): no input gives a 5xx, and every
answer matches the schema (documented status, content type, headers and body)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from conftest import ThreadedServer, bearer, make_settings, new_tokens
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from control_plane.app import create_app

MAX_EXAMPLES = 20  # per operation and mode: keeps the suite near a minute and a half
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
SCHEME_TOKEN = {"adminToken": "admin", "nodeToken": "node", "gatewayToken": "gateway"}

pytestmark = pytest.mark.slow


@pytest.fixture
def fuzz_target(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    tokens = new_tokens()
    # Blocking queries are capped at 0.2 s so fuzzed `wait` values cannot stall the run.
    settings = make_settings(tmp_path / "fuzz.db", tokens, max_wait_s=0.2)
    server = ThreadedServer(create_app(settings), settings)
    base_url = server.start()
    minted = httpx.post(
        base_url + "/v1/nodes/n1/credential",
        json={"region": "us-east"},
        headers=bearer(tokens.admin),
    )
    by_kind = {kind.value: value for kind, value in tokens.items()}
    yield base_url, by_kind | {"node": minted.json()["token"]}
    server.stop()


def token_for(operation: APIOperation, tokens: dict[str, str]) -> str:
    (requirement,) = operation.definition.raw["security"]
    (scheme,) = requirement
    return tokens[SCHEME_TOKEN[scheme]]


def fuzz(operation: APIOperation, mode: GenerationMode, base_url: str, token: str) -> None:
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=base_url, headers=bearer(token), checks=CHECKS)

    check()


def test_fuzzed_requests_get_no_5xx_and_match_the_schema(
    fuzz_target: tuple[str, dict[str, str]],
) -> None:
    base_url, tokens = fuzz_target
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 17
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(operation, mode, base_url, token_for(operation, tokens))
