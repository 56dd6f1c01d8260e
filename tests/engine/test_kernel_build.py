"""The CPU kernels' build: `python -m engine kernels` builds (or finds) them and says so, and the
copies torch compiles are rewritten only when a source changed, so ninja keeps its objects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import kernels


def _kernels_cli(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", "kernels"],
        capture_output=True, text=True, timeout=1200, env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.slow
def test_kernels_command_builds_and_names_the_module() -> None:
    done = _kernels_cli()
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CPU kernels ready: ")
    assert Path(done.stdout.split(": ", 1)[1].strip()).is_file()


@pytest.mark.slow
def test_kernels_command_says_when_they_are_off() -> None:
    done = _kernels_cli(MERIDIAN_CPU_KERNELS="0")
    assert done.returncode == 1
    assert "MERIDIAN_CPU_KERNELS=0" in done.stdout


def test_source_copies_are_rewritten_only_when_they_differ(tmp_path: Path) -> None:
    copies = [Path(p) for p in kernels._copy_sources(kernels._SOURCE_DIR, tmp_path)]
    assert [p.read_bytes() for p in copies] == [
        (Path(kernels.__file__).parent / p.name).read_bytes() for p in copies
    ]
    os.utime(copies[0], (1_000_000, 1_000_000))
    kernels._copy_sources(kernels._SOURCE_DIR, tmp_path)
    assert copies[0].stat().st_mtime == 1_000_000  # unchanged: left alone
    copies[0].write_text("// stale\n")
    kernels._copy_sources(kernels._SOURCE_DIR, tmp_path)
    assert copies[0].read_bytes() == (Path(kernels.__file__).parent / copies[0].name).read_bytes()
