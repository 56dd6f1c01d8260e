"""bench.picker_round_trip end to end at a small size: the real picker process behind its
stand-in control plane names a node for every decided request and none for the floor's, at
both concurrencies; through a real Envoy configured as xDS configures an ingress, every chat
goes to the node the picker named, and Envoy's own timings of it come back from its access
log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.picker_round_trip import main


@pytest.mark.slow
def test_every_decided_request_names_a_node_and_no_floor_request_does(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    out = tmp_path / "report.json"
    main(["--exchanges", "8", "--chats", "32", "--chunks", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    client = report["client"]
    assert [run["concurrency"] for run in client] == [1, 32]
    for run in client:
        assert run["decided"]["exchanges"] == run["decided"]["named_a_node"] == 8
        assert run["floor"]["exchanges"] == 8 and run["floor"]["named_a_node"] == 0
        assert 0 < run["floor"]["p50_ms"] <= run["floor"]["p99_ms"]
    through_envoy = report["envoy"]
    assert [(run["kind"], run["concurrency"]) for run in through_envoy] == [
        ("back to back", 1),
        ("back to back", 32),
        ("paced", 32),
    ]
    for run, num in zip(through_envoy, (8, 32, 32), strict=True):
        assert run["requests"] == num and run["failed"] == 0
        # Envoy follows the picker; a chat the picker answers too late for (its 200 ms, 32 at
        # once on a loaded machine) goes on by least request: one at a time, none may.
        assert 0 < run["went_where_named"] == run["named_a_node"]
        # Envoy waits for the picker's answers before it routes.
        assert 0 < run["body_p50_ms"] <= run["routed_p50_ms"] <= run["routed_p99_ms"]
    assert through_envoy[0]["named_a_node"] == 8
