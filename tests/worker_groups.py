"""Which xdist worker runs what under `make test` (`--dist loadfile`): a file's tests stay together,
so its module fixtures are set up once, and some files go together to one worker:

- the files that load transformers' reference (about 20 s and 1 GB each time, a session
  fixture), so that one worker loads it once;
- the files that start whole fleets of processes, each node loading the model (a stack, a fresh
  install, real nodes killed mid-stream), so that no two of them share the two cores at once:
  side by side they starved each other past their deadlines.

(`--dist loadgroup` would say this with marks, but pytest-xdist 3.8 cannot rename the tests of a
group under pytest 9.2, so the grouping is a scheduler of our own.)
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import Producer

GROUPS = {
    "transformers-reference": (
        "tests/engine/test_engine_vs_transformers.py",
        "tests/engine/test_loader.py",
        "tests/engine/test_tokenizer.py",
    ),
    "whole-fleets": (
        "tests/e2e/test_end_to_end.py",
        "tests/e2e/test_front_end.py",
        "tests/e2e/test_install.py",
        "tests/e2e/test_models_e2e.py",
        "tests/gateway/test_gw_agent_api_live.py",
        "tests/gateway/test_gw_resume_real_nodes.py",
        "tests/stack/test_stack_replicas_up.py",
    ),
}
GROUP_OF = {path: group for group, paths in GROUPS.items() for path in paths}


class FilesInGroups(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return GROUP_OF.get(path, path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return FilesInGroups(config, log)
