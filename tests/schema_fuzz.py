"""Fuzzing a service from its own OpenAPI schema (schemathesis), for the control plane's and the
node agent's fuzz tests: every operation in both generation modes, with a number of cases in
all shared among them. `FUZZ_CASES=N` sets that number for every such test (the issue's full
run: 2000); each test's default keeps the suite fast. Derandomized, so a run is repeatable."""

from __future__ import annotations

import os
from collections.abc import Callable

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.schemas import APIOperation

MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)

Call = Callable[[schemathesis.Case, GenerationMode], None]


def num_fuzz_cases(default: int) -> int:
    return int(os.environ.get("FUZZ_CASES", default))


def fuzz_operations(operations: list[APIOperation], num_cases: int, call: Call) -> int:
    """`call` on about `num_cases` cases drawn for the operations in both modes; returns how many
    it was called on (at least `num_cases` unless every operation ran out of inputs)."""
    # Operations with little to vary run out of cases early: first, so that the others share
    # what they leave.
    ordered = sorted(operations, key=lambda op: (_num_inputs(op), op.label))
    pairs = [(operation, mode) for operation in ordered for mode in MODES]
    num_called = 0
    for i, (operation, mode) in enumerate(pairs):
        budget = -(-max(0, num_cases - num_called) // (len(pairs) - i))
        if budget:
            num_called += _fuzz(operation, mode, budget, call)
    return num_called


def _num_inputs(operation: APIOperation) -> int:
    has_body = operation.body is not None and len(operation.body) > 0
    return len(list(operation.iter_parameters())) + 10 * has_body


def _fuzz(operation: APIOperation, mode: GenerationMode, max_examples: int, call: Call) -> int:
    num_called = 0

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        nonlocal num_called
        num_called += 1
        call(case, mode)

    try:
        check()
    except Unsatisfiable:  # no parameters and no body: nothing to get wrong
        assert mode is GenerationMode.NEGATIVE, operation.label
    return num_called
