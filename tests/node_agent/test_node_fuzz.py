"""The node agent fuzzed from its own OpenAPI schema (schemathesis): whatever a caller with the
serving token sends to any route, the answer is never a 5xx, and every error is in OpenAI's
shape. A real node agent over a real engine core process, with a tiny random model
(tests/tiny_checkpoints.py: a 97-token vocabulary, 128 positions), so that every generation is
short: `FUZZ_CASES=2000` (the issue's full run) takes minutes, not the hours SmolLM2 would."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import requests
import schemathesis
from node_helpers import TINY_SERVED_NAME, BackgroundLoop, NodeHandle, tiny_node
from schema_fuzz import fuzz_operations, num_fuzz_cases
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

NUM_CASES = num_fuzz_cases(300)
SERVED_NAME = TINY_SERVED_NAME
SERVING_TOKEN = "serving-" + "s" * 24
# A drawn model name is almost never the served one, and stops at 404 before the prompt is read:
# all but one in this many schema-valid bodies name the served model instead.
SERVED_MODEL_EVERY = 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", name="tiny_node")
def tiny_node_fixture(
    tmp_path_factory: pytest.TempPathFactory, server_loop: BackgroundLoop
) -> Iterator[NodeHandle]:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    with tiny_node(server_loop, folder, serving_token=SERVING_TOKEN) as node:
        yield node


def assert_openai_error(response: schemathesis.Response) -> None:
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error


def test_fuzzed_requests_get_no_5xx_and_errors_in_openai_shape(tiny_node: NodeHandle) -> None:
    schema = schemathesis.openapi.from_url(tiny_node.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    headers = {"Authorization": f"Bearer {SERVING_TOKEN}"}
    statuses: Counter[int] = Counter()

    with requests.Session() as http:

        def call(case: schemathesis.Case, mode: GenerationMode) -> None:
            is_served = statuses.total() % SERVED_MODEL_EVERY != 0
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and is_served:
                case.body["model"] = SERVED_NAME
            response = case.call(base_url=tiny_node.base_url, session=http, headers=headers)
            statuses[response.status_code] += 1
            case.validate_response(response, checks=[not_a_server_error])
            if response.status_code >= 400:
                assert_openai_error(response)

        num_called = fuzz_operations(operations, NUM_CASES, call)

    print(f"node agent fuzz: {num_called} cases, statuses {dict(statuses)}")
    assert num_called >= NUM_CASES, statuses
    # The cases reach the engine, not only the checks in front of it (1 in 40 at least: random
    # bodies now also meet the checks of tools, response_format and n; a run saw 13 of 300).
    assert statuses[200] >= NUM_CASES // 40, statuses
