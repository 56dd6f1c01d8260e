"""`python -m simulator`: bad arguments are one line and exit 2; a run writes the issue's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import ANY

import pytest

from simulator.__main__ import main
from simulator.models import DEFAULT_MODEL
from simulator.scenarios import PLACED_MODEL, SCENARIOS


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--scenario", "nope"], "invalid choice: 'nope'"),
        (["run", "--scenario", "steady", "--requests", "0"], "must be at least 1"),
        (["run", "--scenario", "steady", "--requests", "-5"], "must be at least 1"),
        (["run", "--scenario", "steady", "--policies", "fastest"], "unknown policy 'fastest'"),
        (["run"], "required: --scenario"),
        (["run", "--scenario", "steady", "--edge", "--auto-share", "2"], "must be within 0-1"),
        (["run", "--scenario", "steady", "--edge-max-tokens", "0"], "must be at least 1"),
        (["run", "--scenario", "steady", "--deflect-at-waiting", "-1"], "must be at least 0"),
        (["run", "--scenario", "steady", "--picker", "maybe"], "invalid choice: 'maybe'"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_bad_calibration_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "cal.json"
    bad.write_text('{"step_s": 1}')
    assert main(["run", "--scenario", "steady", "--calibration", str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_run_prints_the_table_and_writes_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    args = ["run", "--scenario", "steady", "--requests", "100", "--json", str(out)]
    assert main([*args, "--policies", "meridian,oracle", "--jobs", "1"]) == 0  # no processes
    assert "meridian" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["scenario"], result["seed"], result["requests"]) == ("steady", 0, 100)
    assert set(result["policies"]) == {"meridian", "oracle"}
    assert set(result["policies"]["meridian"]) == {
        "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "e2e_p99_s", "goodput", "failed", "retried",
        "lost", "resumed", "resume_p99_s", "edge_share", "auto_ttft_p99_s", "models",
        "floor_p99_s", "cache_share",
    }  # fmt: skip
    assert result["bound"] == {"policy": "oracle", "ttft_p99_s": ANY}
    meridian = result["policies"]["meridian"]
    assert meridian["floor_p99_s"] <= meridian["ttft_p99_s"]
    assert result["policies"]["meridian"]["models"] == {
        DEFAULT_MODEL: {"requests": 100, "ttft_p99_s": ANY, "failed": 0, "by_fallback": 0}
    }
    assert result["node_picker"] is True  # the default: each region's picker names the node
    assert result["edge"] is False and result["policies"]["meridian"]["edge_share"] == 0.0
    assert result["policies"]["meridian"]["auto_ttft_p99_s"] is None  # no `auto` requests
    assert result["policies"]["meridian"]["resume_p99_s"] is None  # no stream broke


def test_a_run_with_a_placed_model_shows_its_requests_and_plots_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out, plots = tmp_path / "out.json", tmp_path / "plots"
    args = ["run", "--scenario", "model_fallback", "--requests", "300", "--jobs", "1"]
    assert (
        main([*args, "--policies", "meridian,oracle", "--json", str(out), "--plots", str(plots)])
        == 0
    )
    printed = capsys.readouterr().out
    assert f"placed model: {PLACED_MODEL}" in printed and "by fallback" in printed
    models = json.loads(out.read_text())["policies"]["meridian"]["models"]
    assert set(models) == {DEFAULT_MODEL, PLACED_MODEL}
    assert models[DEFAULT_MODEL]["requests"] + models[PLACED_MODEL]["requests"] == 300
    assert (plots / "model_fallback_placed_model.png").stat().st_size > 0


@pytest.mark.slow  # every scenario simulated: seconds of CPU
def test_all_runs_every_scenario_and_writes_a_list(tmp_path: Path) -> None:
    out = tmp_path / "all.json"
    args = ["run", "--scenario", "all", "--requests", "30", "--policies", "oracle"]
    assert main([*args, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["scenario"] for r in results] == list(SCENARIOS)
    assert all(r["policies"]["oracle"]["lost"] == 0 for r in results)


def test_a_bad_routing_policy_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--scenario", "steady", "--routing", '{"rtt_weight": 0, "queue_weight": 0}'])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "cannot both be 0" in err and err.count("\n") == 1


def test_picker_off_leaves_the_node_to_least_request_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "off.json"
    argv = ["run", "--scenario", "prefix_heavy", "--requests", "100", "--json", str(out)]
    assert main([*argv, "--policies", "meridian", "--jobs", "1", "--picker", "off"]) == 0
    assert "picker off" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["node_picker"] is False
    assert 0.0 <= result["policies"]["meridian"]["cache_share"] <= 1.0
