"""The CPU kernels' build: `python -m engine kernels` builds (or finds) them and says so, a module
built once is imported as it is (torch is not asked again), and the copies torch compiles are
rewritten only when a source changed, so ninja keeps its objects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from torch.utils import cpp_extension

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


def _no_torch_build(*args: object, **kwargs: object) -> None:
    raise AssertionError("torch's load() ran: it rewrites build.ninja with this torch's paths")


@pytest.mark.slow
def test_a_module_built_once_is_imported_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another checkout or environment with the same torch version shares the build: asking
    torch to load it from there would rebuild it (its ninja file holds the paths)."""
    first = kernels.build_cpu_kernels(kernels._SOURCE_DIR)
    assert first is not None
    monkeypatch.setattr(cpp_extension, "load", _no_torch_build)
    again = kernels.build_cpu_kernels(kernels._SOURCE_DIR)
    assert again is not None and again.__file__ == first.__file__


def test_a_module_cut_short_while_linking_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = kernels.kernel_module_name(kernels._SOURCE_DIR)
    (tmp_path / name).mkdir()
    cut = tmp_path / name / f"{name}.so"
    cut.write_bytes(b"\x7fELF")  # what a killed link leaves
    asked: list[str] = []

    def build(name: str, **kwargs: object) -> ModuleType:
        asked.append(name)
        assert not cut.exists()
        return ModuleType(name)

    monkeypatch.setattr(cpp_extension, "load", build)
    assert kernels.build_cpu_kernels(kernels._SOURCE_DIR) is not None
    assert asked == [name]
