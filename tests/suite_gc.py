"""The collector kept off what every test process builds before its first test, and off what
each test file leaves alive.

A worker imports torch, hypothesis, schemathesis, the services and every test module: about
460,000 objects the collector tracks, which each full collection walked again (14.8 CPU-s of
`make test-fast`'s ~95 went to collections, most of it to these). Off while the modules are
collected, then what they built is frozen out of its reach. After each test file what is still
alive (session fixtures such as transformers' reference model, caches) is frozen too: a worker's
full collections otherwise walked all that its earlier files left (in `make test`, 91 full
collections of the worker that loads the real models took 28.6 CPU-s). What the tests make is
collected as usual; garbage that a frozen object later becomes is freed by reference counting,
or kept until the worker ends."""

from __future__ import annotations

import gc

import pytest


def pytest_configure(config: pytest.Config) -> None:
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()
    gc.enable()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    result = yield
    if nextitem is None or nextitem.path != item.path:  # the file's fixtures are finalized
        gc.collect()
        gc.freeze()
    return result
