"""The two cache views measured against real block pools (bench/cache_views.py, small): the
exact index predicts every node's cached prefix exactly; the approximate one guesses cached
what eviction took, and misses what reached a node without the picker."""

from __future__ import annotations

import argparse

import pytest

from bench.cache_views import RunResult, run


def measure(pool_blocks: int, unseen: float, placement: str) -> RunResult:
    args = argparse.Namespace(
        nodes=3, tenants=4, system_tokens=320, requests=120, max_running=2, seed=0
    )
    return run(args, pool_blocks, unseen, placement)


@pytest.mark.parametrize(
    ("pool_blocks", "unseen", "placement"),
    [(1024, 0.0, "random"), (48, 0.0, "random"), (1024, 0.3, "exact"), (48, 0.3, "approximate")],
)
def test_the_exact_view_predicts_every_nodes_cached_prefix(
    pool_blocks: int, unseen: float, placement: str
) -> None:
    result = measure(pool_blocks, unseen, placement)
    assert result.exact.num_exact == result.exact.num_pairs > 0


def test_the_approximate_view_is_exact_only_while_it_sees_everything_and_nothing_evicts() -> None:
    roomy = measure(1024, 0.0, "random").approximate
    assert roomy.num_exact == roomy.num_pairs
    evicting = measure(48, 0.0, "random").approximate
    assert evicting.blocks_over > 0 and evicting.blocks_under == 0
    unseen = measure(1024, 0.3, "random").approximate
    assert unseen.blocks_under > 0 and unseen.blocks_over == 0
