"""Which xdist worker runs what under `make test` (`--dist loadfile`): a file's tests stay together,
so its module fixtures are set up once, and the files that load transformers' reference (about
20 s and 1 GB each time, a session fixture) go together to one worker, which loads it once.

(`--dist loadgroup` would say this with marks, but pytest-xdist 3.8 cannot rename the tests of a
group under pytest 9.2, so the grouping is a scheduler of our own.)
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import Producer

REFERENCE_FILES = frozenset(
    {
        "tests/engine/test_engine_vs_transformers.py",
        "tests/engine/test_loader.py",
        "tests/engine/test_tokenizer.py",
    }
)


class ReferenceFilesTogether(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return "transformers-reference" if path in REFERENCE_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return ReferenceFilesTogether(config, log)
