"""Fixtures for the end-to-end test: Terraform kept offline (as tests/terraform does, with the
same helpers), and no MERIDIAN_* or TF_* settings leaking in from the calling shell."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from suite_env import clear_settings
from tf_helpers import write_cli_config


@pytest.fixture
def offline_terraform_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Process environment for Terraform and the provisioners' commands: offline, no user
    config, `python` is this interpreter; MERIDIAN_* (but the model store's home and the suite's
    pins) cleared."""
    root = tmp_path / "terraform-env"
    root.mkdir()
    clear_settings(monkeypatch, "TF_", "MERIDIAN_", keep=("MERIDIAN_HOME",))
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", str(write_cli_config(root)))
    (root / "plugin-cache").mkdir()
    monkeypatch.setenv("TF_PLUGIN_CACHE_DIR", str(root / "plugin-cache"))
    monkeypatch.setenv("TF_IN_AUTOMATION", "1")
    monkeypatch.setenv("TF_INPUT", "0")
    monkeypatch.setenv("CHECKPOINT_DISABLE", "1")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    yield root
