"""The collector kept off what every test process builds before its first test.

A worker imports torch, hypothesis, schemathesis, the services and every test module: about
460,000 objects the collector tracks, which each full collection walked again (14.8 CPU-s of
`make test-fast`'s ~95 went to collections, most of it to these). Off while the modules are
collected, then what they built is frozen out of its reach; what the tests make is collected as
usual."""

from __future__ import annotations

import gc

import pytest


def pytest_configure(config: pytest.Config) -> None:
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()
    gc.enable()
