"""`python -m control_plane.admin_cli RESOURCE ...` called in-process through `main` against a
control plane on loopback, as a test runs it: `cli = cli_fixture("model")` in a test module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import ControlPlaneClient

from control_plane.admin_cli import main

Cli = Callable[..., tuple[int, str, str]]  # `RESOURCE ARGS` -> (exit status, stdout, stderr)


def admin_cli(
    cp: ControlPlaneClient,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    resource: str,
) -> Cli:
    """Runs `resource`'s actions against `cp` (a bad argument's exit is a status like any)."""
    monkeypatch.setenv("MERIDIAN_CONTROL_PLANE_URL", cp.base_url)
    monkeypatch.setenv("MERIDIAN_ADMIN_TOKEN", cp.tokens.admin)

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            status = main([resource, *argv])
        except SystemExit as exc:  # argparse's refusal of a bad value
            status = int(exc.code or 0)
        out, err = capsys.readouterr()
        return status, out.strip(), err.strip()

    return run


def cli_fixture(resource: str) -> Any:
    """A `cli` fixture running `resource`'s actions against the test's `live_cp`."""

    @pytest.fixture
    def cli(
        live_cp: ControlPlaneClient,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
    ) -> Cli:
        return admin_cli(live_cp, monkeypatch, capsys, resource)

    return cli
