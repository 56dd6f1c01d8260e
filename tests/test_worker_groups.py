"""The suite's xdist scheduler (tests/worker_groups.py): whole files and groups to one worker, the
longest first, each worker sent the indices of those very tests in its own collection."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from worker_groups import FilesInGroups

COLLECTION = [
    "tests/control_plane/test_a.py::test_1",
    "tests/control_plane/test_a.py::test_2",
    "tests/engine/test_loader.py::test_1",
    "tests/engine/test_parallel.py::test_1",
    "tests/engine/test_tokenizer.py::test_1",
    "tests/engine/test_tokenizer.py::test_2",
    "tests/gateway/test_b.py::test_1",
    "tests/gateway/test_b.py::test_2",
    "tests/gateway/test_b.py::test_3",
]


class FakeWorker:
    """What the scheduler uses of xdist's WorkerController."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_each_worker_runs_whole_files_and_groups_in_the_queue_s_order() -> None:
    config = SimpleNamespace(option=SimpleNamespace(), getvalue=lambda name: ["3*popen"])
    scheduler = FilesInGroups(cast(pytest.Config, config))
    workers = [FakeWorker(f"gw{i}") for i in range(3)]
    for worker in workers:
        scheduler.add_node(cast(Any, worker))
        scheduler.add_node_collection(cast(Any, worker), COLLECTION)
    scheduler.schedule()
    ran = [[COLLECTION[i] for i in worker.sent] for worker in workers]
    files = [sorted({nodeid.split("::")[0] for nodeid in tests}) for tests in ran]
    # test_parallel first (LONGEST_FIRST), then the transformers reference's group, then the
    # rest by size: each worker's first unit whole, on that worker alone.
    assert ran[0][0] == "tests/engine/test_parallel.py::test_1"
    assert ran[1][:3] == [
        "tests/engine/test_loader.py::test_1",
        "tests/engine/test_tokenizer.py::test_1",
        "tests/engine/test_tokenizer.py::test_2",
    ]
    assert ran[2][:3] == [f"tests/gateway/test_b.py::test_{i}" for i in (1, 2, 3)]
    assert sorted(nodeid for tests in ran for nodeid in tests) == sorted(COLLECTION)  # all once
    for path in {nodeid.split("::")[0] for nodeid in COLLECTION}:
        assert sum(path in names for names in files) == 1, path
