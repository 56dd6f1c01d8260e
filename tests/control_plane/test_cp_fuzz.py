"""The API fuzzed from its own OpenAPI schema (schemathesis): no input gives a 5xx, and every
answer matches the schema (documented status, content type, headers and body). Every operation
(admin, node and gateway) with its own credential, in both modes; `FUZZ_CASES=2000` for the
issue's full run (tests/schema_fuzz.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from conftest import ThreadedServer, bearer, make_settings, new_tokens
from schema_fuzz import fuzz_operations, num_fuzz_cases
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

NUM_CASES = num_fuzz_cases(500)  # in all
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


def test_fuzzed_requests_get_no_5xx_and_match_the_schema(
    fuzz_target: tuple[str, dict[str, str]],
) -> None:
    base_url, tokens = fuzz_target
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 17

    def call(case: schemathesis.Case, mode: GenerationMode) -> None:
        headers = bearer(token_for(case.operation, tokens))
        case.call_and_validate(base_url=base_url, headers=headers, checks=CHECKS)

    num_called = fuzz_operations(operations, NUM_CASES, call)
    print(f"control plane fuzz: {num_called} cases over {len(operations)} operations")
    assert num_called >= NUM_CASES
