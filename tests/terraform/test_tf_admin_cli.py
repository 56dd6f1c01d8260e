"""`python -m control_plane.admin_cli`, the command the region module's provisioners run, against
a real control plane (called in-process through `main`; one subprocess run checks the module
entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tf_helpers import REPO_ROOT, ControlPlane

from control_plane import admin_client
from control_plane.admin_cli import main

pytestmark = pytest.mark.slow  # starts a control plane


@pytest.fixture
def cp(shared_control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> ControlPlane:
    """The shared control plane, named by the environment as the provisioners name it."""
    monkeypatch.setenv("MERIDIAN_CONTROL_PLANE_URL", shared_control_plane.base_url)
    monkeypatch.setenv("MERIDIAN_ADMIN_TOKEN", shared_control_plane.admin_token)
    return shared_control_plane


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out.strip(), err.strip()


def test_put_creates_then_finds_unchanged_then_updates_in_place(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    put = (
        "region",
        "put",
        "cli-a",
        "--lat=10.5",
        "--lon=-20.25",
        "--ingress-url=http://127.0.0.1:1",
    )
    assert run_cli(capsys, *put) == (0, "region cli-a: created", "")
    created = cp.regions()["cli-a"]
    assert (created["lat"], created["lon"], created["ingress_url"]) == (
        10.5,
        -20.25,
        "http://127.0.0.1:1",
    )
    assert run_cli(capsys, *put) == (0, "region cli-a: unchanged", "")
    assert cp.regions()["cli-a"]["updated_at"] == created["updated_at"]

    # Put semantics: what is left out takes its default (the ingress is cleared, weight 1).
    assert run_cli(capsys, "region", "put", "cli-a", "--lat=11", "--lon=-21", "--weight=3") == (
        0,
        "region cli-a: updated",
        "",
    )
    updated = cp.regions()["cli-a"]
    assert (updated["lat"], updated["lon"], updated["weight"]) == (11.0, -21.0, 3.0)
    assert updated["ingress_url"] is None
    assert updated["created_at"] == created["created_at"]


def test_put_sets_moves_and_clears_the_regions_picker(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    put = ("region", "put", "cli-p", "--lat=1", "--lon=2")
    assert run_cli(capsys, *put, "--picker=127.0.0.1:9100") == (0, "region cli-p: created", "")
    assert cp.regions()["cli-p"]["picker"] == "127.0.0.1:9100"
    assert run_cli(capsys, *put, "--picker=127.0.0.1:9100")[1] == "region cli-p: unchanged"
    assert run_cli(capsys, *put, "--picker=10.0.0.5:9100")[1] == "region cli-p: updated"
    assert cp.regions()["cli-p"]["picker"] == "10.0.0.5:9100"
    assert run_cli(capsys, *put)[1] == "region cli-p: updated"  # left out: cleared
    assert cp.regions()["cli-p"]["picker"] is None
    status, _, err = run_cli(capsys, *put, "--picker=picker.internal:9100")
    assert status == 1 and "picker" in err


def test_put_leaves_the_operators_state_alone(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(capsys, "region", "put", "cli-b", "--lat=1", "--lon=2")[0] == 0
    cp.request("PATCH", "/v1/regions/cli-b", {"state": "disabled"})
    assert run_cli(capsys, "region", "put", "cli-b", "--lat=5", "--lon=6")[1] == (
        "region cli-b: updated"
    )
    region = cp.regions()["cli-b"]
    assert (region["lat"], region["state"]) == (5.0, "disabled")


def test_delete_is_idempotent(cp: ControlPlane, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "region", "put", "cli-c", "--lat=1", "--lon=2")[0] == 0
    assert run_cli(capsys, "region", "delete", "cli-c") == (0, "region cli-c: deleted", "")
    assert "cli-c" not in cp.regions()
    assert run_cli(capsys, "region", "delete", "cli-c") == (0, "region cli-c: already absent", "")


def test_node_credentials_are_minted_into_private_files_and_never_printed(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run_cli(capsys, "region", "put", "cli-n", "--lat=1", "--lon=2")[0] == 0
    argv = ("node", "credentials", "cli-n", f"--token-dir={tmp_path / 'tokens'}")
    status, out, err = run_cli(
        capsys, *argv, "--node=cli-n-00=http://127.0.0.1:9", "--node=cli-n-01"
    )
    assert (status, err) == (0, "")
    files = [tmp_path / "tokens" / f"cli-n-0{i}.token" for i in range(2)]
    assert out.splitlines() == [
        f"node cli-n-0{i}: credential written to {files[i]}" for i in (0, 1)
    ]
    tokens = [path.read_text().strip() for path in files]
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in files)
    assert len(set(tokens)) == 2 and not any(token in out for token in tokens)
    beat = heartbeat_of("cli-n-00", "cli-n")
    cp.request("POST", "/v1/nodes/heartbeat", beat, token=tokens[0])
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--node=Bad Node"])
    assert exited.value.code == 2 and "'Bad Node' is not a node id" in capsys.readouterr().err


def test_xds_credentials_are_minted_into_private_files_and_never_printed(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "envoy" / "cli-x.token"
    argv = ("xds", "credential", "envoy-cli-x", "--region=cli-x", f"--token-file={path}")
    status, out, err = run_cli(capsys, *argv)
    assert (status, out, err) == (0, f"xds credential envoy-cli-x: written to {path}", "")
    first = path.read_text().strip()
    assert first.startswith("mxds-") and path.stat().st_mode & 0o777 == 0o600
    assert run_cli(capsys, *argv)[0] == 0  # minted again: replaced
    assert path.read_text().strip() != first
    edge = tmp_path / "edge.token"
    edge_argv = ("xds", "credential", "edge-cli", "--edge", f"--token-file={edge}")
    assert run_cli(capsys, *edge_argv)[0] == 0
    listed = {c["name"]: c for c in cp.request("GET", "/v1/xds/credentials")["credentials"]}
    assert (listed["envoy-cli-x"]["role"], listed["envoy-cli-x"]["region"]) == ("ingress", "cli-x")
    assert (listed["edge-cli"]["role"], listed["edge-cli"]["region"]) == ("edge", None)
    with pytest.raises(SystemExit) as exited:
        main(["xds", "credential", "x", "--region=r", "--edge", f"--token-file={edge}"])
    assert exited.value.code == 2 and "not allowed with" in capsys.readouterr().err


def heartbeat_of(node_id: str, region: str) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "node_id": node_id,
        "region": region,
        "url": "http://127.0.0.1:9",
        "model": "smollm2-135m-instruct",
        "kv_blocks_total": 100,
        "kv_blocks_free": 100,
        "block_size": 16,
        "timestamp": time.time(),
    }


def test_a_region_with_nodes_is_deleted_after_they_drain_and_cannot_be_put_meanwhile(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run_cli(capsys, "region", "put", "cli-h", "--lat=1", "--lon=2")[0] == 0
    argv = ("node", "credentials", "cli-h", f"--token-dir={tmp_path}", "--node=cli-h-00")
    assert run_cli(capsys, *argv)[0] == 0
    token = (tmp_path / "cli-h-00.token").read_text().strip()
    cp.request("POST", "/v1/nodes/heartbeat", heartbeat_of("cli-h-00", "cli-h"), token=token)
    assert run_cli(capsys, "region", "delete", "cli-h") == (
        0,
        "region cli-h: deleting (its nodes drain first)",
        "",
    )
    status, _, err = run_cli(capsys, "region", "put", "cli-h", "--lat=1", "--lon=2")
    assert status == 1
    assert "the region is being deleted (its nodes are draining)" in err
    status, _, err = run_cli(capsys, "region", "delete", "cli-h", "--wait-s=0.6")
    assert status == 1
    assert "still deleting after 0.6 s while its nodes drain" in err


def test_wrong_token_is_one_clear_line_without_the_token(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = "not-the-token-" + "z" * 16
    monkeypatch.setenv("MERIDIAN_ADMIN_TOKEN", wrong)
    status, out, err = run_cli(capsys, "region", "put", "cli-d", "--lat=1", "--lon=2")
    assert (status, out) == (1, "")
    assert err == (
        f"admin_cli: error: the control plane at {cp.base_url} refused the admin token "
        "(401 invalid bearer token); check MERIDIAN_ADMIN_TOKEN (Terraform: admin_token)"
    )
    assert wrong not in err
    assert "cli-d" not in cp.regions()


def test_rejected_values_are_reported_with_the_control_planes_reason(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_cli(capsys, "region", "put", "cli-e", "--lat=95", "--lon=2")
    assert status == 1
    assert err.startswith("admin_cli: error: region put cli-e: 422 lat:"), err


def test_unreachable_control_plane(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin_client, "TIMEOUT_S", 2.0)
    monkeypatch.setenv("MERIDIAN_CONTROL_PLANE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("MERIDIAN_ADMIN_TOKEN", "t" * 20)
    status, _, err = run_cli(capsys, "region", "delete", "cli-f")
    assert status == 1
    assert err.startswith("admin_cli: error: cannot reach the control plane at http://127.0.0.1:9")


def test_a_replica_that_cannot_be_reached_is_skipped_for_the_next(
    cp: ControlPlane, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin_client, "TIMEOUT_S", 2.0)
    monkeypatch.setenv("MERIDIAN_CONTROL_PLANE_URL", f"http://127.0.0.1:9,{cp.base_url}")
    put = ("region", "put", "cli-r", "--lat=1", "--lon=2")
    assert run_cli(capsys, *put) == (0, "region cli-r: created", "")
    assert cp.regions()["cli-r"]["lat"] == 1.0
    assert run_cli(capsys, "region", "delete", "cli-r")[0] == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MERIDIAN_ADMIN_TOKEN": "t" * 20}, "set MERIDIAN_CONTROL_PLANE_URL"),
        ({"MERIDIAN_CONTROL_PLANE_URL": "http://127.0.0.1:1"}, "set MERIDIAN_ADMIN_TOKEN"),
        (
            {"MERIDIAN_CONTROL_PLANE_URL": "127.0.0.1:1", "MERIDIAN_ADMIN_TOKEN": "t" * 20},
            "control plane URL must be http(s)://HOST[:PORT]",
        ),
    ],
)
def test_missing_settings_are_usage_errors(
    env: dict[str, str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("MERIDIAN_CONTROL_PLANE_URL", "MERIDIAN_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status, _, err = run_cli(capsys, "region", "delete", "x")
    assert status == 2
    assert message in err


def test_region_names_are_checked_before_any_call(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["region", "delete", "../keys"])
    assert exit_info.value.code == 2
    assert "is not a region name" in capsys.readouterr().err


def test_runs_as_a_module_with_the_token_only_in_its_environment(cp: ControlPlane) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    result = subprocess.run(
        [sys.executable, "-m", "control_plane.admin_cli", "region", "put", "cli-g"]
        + ["--lat=1", "--lon=2"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "region cli-g: created\n", "")
    assert "cli-g" in cp.regions()
