"""Which xdist worker runs what under `make test` (`--dist loadfile`): a file's tests stay together,
so its module fixtures are set up once, and some files go together to one worker:

- the files that load transformers' reference (about 20 s and 1 GB each time, a session
  fixture), so that one worker loads it once;
- the files that start whole fleets of processes, each node loading the model (a stack, a fresh
  install, real nodes killed mid-stream), so that no two of them share the two cores at once:
  side by side they starved each other past their deadlines.

And the longest files and groups are handed out first (LONGEST_FIRST), the rest by number of
tests as xdist orders them: by number of tests alone, the fleets (23 tests, 15-20 min of one
worker under load) came 20th and test_parallel (18 tests, 8 min) 30th, and a long file handed out
late runs on alone at the end while the other workers idle.

(`--dist loadgroup` would say this with marks, but pytest-xdist 3.8 cannot rename the tests of a
group under pytest 9.2, so the grouping is a scheduler of our own.)
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import Producer, WorkerController

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
# Longest first, by the 30 slowest of a whole run (make test, 3 workers, load 4-8): the fleets,
# the TP/PP parity runs, the transformers reference, the real model's engine and node tests.
LONGEST_FIRST = (
    "whole-fleets",
    "tests/engine/test_parallel.py",
    "transformers-reference",
    "tests/node_agent/test_resume.py",
    "tests/engine/test_gemv_kernels.py",
    "tests/node_agent/test_node_fuzz.py",
    "tests/engine/test_q4_weights.py",
    "tests/gateway/test_gw_fuzz.py",
    "tests/engine/test_kv_cache_dtype.py",
    "tests/engine/test_int8_weights.py",
    "tests/gateway/test_gw_real_nodes.py",
)


def scope_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return GROUP_OF.get(path, path)


def running_order(work_units: dict[str, dict[str, bool]]) -> list[str]:
    """The scopes LONGEST_FIRST, then by number of tests (a stable sort: ties keep their order)."""

    def rank(scope: str) -> tuple[int, int]:
        first = LONGEST_FIRST.index(scope) if scope in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, -len(work_units[scope])

    return sorted(work_units, key=rank)


class FilesInGroups(LoadFileScheduling):
    """The work queue in our order. Only the queue: xdist names a test to a worker by its index
    in the worker's own collection, so reordering the collections (as this class once did) sent
    each worker other tests than the queue's: files split over all the workers, each setting
    up the module fixtures again, and the fleets' group ran beside other fleets."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # xdist's own order (by size) would undo ours
        self._is_ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._is_ordered:  # the first assignment: schedule() has just built the queue
            self._is_ordered = True
            units = dict(self.workqueue)
            self.workqueue.clear()
            self.workqueue.update((scope, units[scope]) for scope in running_order(units))
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return FilesInGroups(config, log)
