"""`python -m control_plane` as a real process: state survives a restart with the same --db;
loopback tokens; refusing to start without tokens off loopback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import REPO_ROOT, bearer, heartbeat, new_tokens
from suite_env import child_env

from control_plane.tokens import TokenKind, read_token_file

pytestmark = pytest.mark.slow


# uvicorn shuts down gracefully on SIGTERM, then re-raises the signal.
CLEAN_EXIT = (0, -signal.SIGTERM)


def token_env(tokens: Any) -> dict[str, str]:
    return {
        "MERIDIAN_ADMIN_TOKEN": tokens.admin,
        "MERIDIAN_GATEWAY_TOKEN": tokens.gateway,
    }


def changes_of(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Audit entries made by callers (the drain sequence adds its own as it moves)."""
    return [entry for entry in entries if entry["actor"] != "control_plane"]


def test_state_survives_a_restart(tmp_path: Path, start_process: Any) -> None:
    tokens = new_tokens()
    db = str(tmp_path / "fleet.db")
    admin, gateway = bearer(tokens.admin), bearer(tokens.gateway)
    first = start_process(["--db", db, "--heartbeat-interval", "0.5"], token_env(tokens))
    with httpx.Client(base_url=first.base_url, timeout=5) as http:
        region = {"name": "us-east", "lat": 40.7, "lon": -74.0, "ingress_url": "http://127.0.0.1:1"}
        assert http.post("/v1/regions", json=region, headers=admin).status_code == 201
        kept = http.post("/v1/keys", json={"name": "a", "rpm": 1, "tpm": 2}, headers=admin).json()
        gone = http.post("/v1/keys", json={"name": "b", "rpm": 3, "tpm": 4}, headers=admin).json()
        assert http.delete(f"/v1/keys/{gone['id']}", headers=admin).status_code == 204
        minted = http.post("/v1/nodes/n1/credential", json={"region": "us-east"}, headers=admin)
        node = bearer(minted.json()["token"])
        assert http.post("/v1/nodes/heartbeat", json=heartbeat("n1"), headers=node).is_success
        assert http.post("/v1/nodes/n1/drain", headers=admin).is_success
        assert http.put("/v1/routing", json={"rtt_weight": 3.0}, headers=admin).is_success
        summary_index = int(http.get("/v1/regions/summary", headers=gateway).json()["index"])
        keys_index = int(http.get("/v1/keys/snapshot", headers=gateway).json()["index"])
        audit_before = changes_of(http.get("/v1/audit", headers=admin).json()["entries"])
    assert first.stop() in CLEAN_EXIT

    second = start_process(["--db", db, "--heartbeat-interval", "0.5"], token_env(tokens))
    with httpx.Client(base_url=second.base_url, timeout=5) as http:
        regions = http.get("/v1/regions", headers=admin).json()["regions"]
        assert [(r["name"], r["ingress_url"]) for r in regions] == [
            ("us-east", "http://127.0.0.1:1")
        ]
        keys = {k["id"]: k for k in http.get("/v1/keys", headers=admin).json()["keys"]}
        assert keys[kept["id"]]["revoked_at"] is None and keys[gone["id"]]["revoked_at"]
        snapshot = http.get("/v1/keys/snapshot", headers=gateway).json()
        assert snapshot["index"] == keys_index
        assert [k["id"] for k in snapshot["keys"]] == [kept["id"]]
        (n1,) = http.get("/v1/nodes", headers=admin).json()["nodes"]
        # Durable: identity and the drain request; health is the last known, for a grace period.
        assert n1["drain_requested"] is True and n1["is_healthy"] is True
        assert n1["drain"]["reason"] == "operator"  # its drain sequence goes on where it was
        assert http.get("/v1/routing", headers=admin).json()["rtt_weight"] == 3.0
        summary = http.get("/v1/regions/summary", headers=gateway).json()
        assert summary["index"] > summary_index  # never goes backwards across restarts
        assert summary["routing"]["rtt_weight"] == 3.0
        audit_after = changes_of(http.get("/v1/audit", headers=admin).json()["entries"])
        assert audit_after == audit_before
        reply = http.post("/v1/nodes/heartbeat", json=heartbeat("n1"), headers=node).json()
        assert reply["drain"] is True
    assert second.stop() in CLEAN_EXIT
    assert "Application shutdown complete" in (tmp_path / "control_plane.log").read_text()


def test_loopback_without_tokens_generates_and_keeps_them(
    tmp_path: Path, start_process: Any
) -> None:
    db = tmp_path / "cp.db"
    first = start_process(["--db", str(db)])
    token_file = tmp_path / "cp.db.tokens"
    stored = read_token_file(token_file)
    assert set(stored) == {TokenKind.ADMIN, TokenKind.GATEWAY}
    admin = bearer(stored[TokenKind.ADMIN])
    with httpx.Client(base_url=first.base_url, timeout=5) as http:
        assert http.get("/v1/status", headers=admin).status_code == 200
        assert http.get("/v1/status").status_code == 401
    first.stop()
    log = (tmp_path / "control_plane.log").read_text()
    assert str(token_file) in log and stored[TokenKind.ADMIN] not in log

    second = start_process(["--db", str(db)])
    with httpx.Client(base_url=second.base_url, timeout=5) as http:
        assert http.get("/v1/status", headers=admin).status_code == 200


def test_refuses_to_serve_off_loopback_without_tokens(tmp_path: Path) -> None:
    env = child_env()
    env["MERIDIAN_ADMIN_TOKEN"] = "secret-admin-token-123456"
    result = subprocess.run(
        [sys.executable, "-m", "control_plane", "--host", "0.0.0.0", "--db", str(tmp_path / "x")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "MERIDIAN_GATEWAY_TOKEN" in lines[0]
    assert "secret-admin-token" not in result.stderr
    assert not (tmp_path / "x").exists()


def test_a_taken_port_is_one_line_and_exit_1(tmp_path: Path) -> None:
    env = child_env()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "control_plane", "--port", str(port)]
            + ["--db", str(tmp_path / "cp.db"), "--dns-port", "0", "--xds-port", "0"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"control_plane: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
