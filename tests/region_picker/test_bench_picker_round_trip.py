"""bench.picker_round_trip end to end at a small size: the real picker process behind its
stand-in control plane names a node for every decided request and none for the floor's, at
both concurrencies, and the report says so."""

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
    main(["--exchanges", "8", "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [run["concurrency"] for run in runs] == [1, 32]
    for run in runs:
        assert run["decided"]["exchanges"] == run["decided"]["named_a_node"] == 8
        assert run["floor"]["exchanges"] == 8 and run["floor"]["named_a_node"] == 0
        assert 0 < run["floor"]["p50_ms"] <= run["floor"]["p99_ms"]
