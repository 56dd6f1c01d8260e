"""bench/kernel_ab.py builds another revision's kernels beside this checkout's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.kernel_ab import KERNELS_DIR, kernels_at
from engine.kernels import cpu_kernels

pytestmark = pytest.mark.slow  # runs git


def test_an_unknown_revision_is_refused_before_any_build(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        kernels_at("no-such-revision", tmp_path)
    assert not any(tmp_path.iterdir())


def test_head_builds_from_its_archive(tmp_path: Path) -> None:
    if cpu_kernels() is None:
        pytest.skip("the native CPU kernels could not be built here")
    module = kernels_at("HEAD", tmp_path)
    assert (tmp_path / KERNELS_DIR / "paged_attention_cpu.cpp").exists()
    assert callable(module.decode_layers) and callable(module.paged_decode_attention)
