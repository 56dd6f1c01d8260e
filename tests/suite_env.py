"""The settings the whole suite runs under, and the environment of the processes tests start.

Tests decide every MERIDIAN_* setting themselves, so the calling shell's are cleared, but the
suite's own pins stay, in the test processes and in every process a test starts (a node agent,
a stack's nodes, a tensor-parallel rank): without MERIDIAN_MATMUL_CROSSOVER each engine start
times its matmuls, 6-8 s of CPU per process on the 2-core machine, and what the probes find is
not what those tests test (tests/engine/test_dense_matmul.py measures them).
"""

from __future__ import annotations

import os

import pytest

# 16 keeps both paths in use: oneDNN's fp32 and the bf16 kernel up to 16 tokens, F.linear past.
PINS = {"MERIDIAN_MATMUL_CROSSOVER": "16"}


def pin() -> None:
    """The pins, where the calling shell has not set them (an empty value probes)."""
    for name, value in PINS.items():
        os.environ.setdefault(name, value)


def _cleared(name: str, prefixes: tuple[str, ...], keep: tuple[str, ...]) -> bool:
    return name.startswith(prefixes) and name not in PINS and name not in keep


def child_env(*prefixes: str, keep: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without the settings under `prefixes` (MERIDIAN_ when none
    is given), but the suite's pins and the names in `keep`."""
    prefixes = prefixes or ("MERIDIAN_",)
    return {k: v for k, v in os.environ.items() if not _cleared(k, prefixes, keep)}


def clear_settings(
    monkeypatch: pytest.MonkeyPatch, *prefixes: str, keep: tuple[str, ...] = ()
) -> None:
    """child_env's clearing, applied to this process for the length of a test."""
    prefixes = prefixes or ("MERIDIAN_",)
    for name in list(os.environ):
        if _cleared(name, prefixes, keep):
            monkeypatch.delenv(name)
