"""The worlds' split over worker processes: each policy once, the costliest group cheapest."""

from __future__ import annotations

from simulator.policies import POLICIES
from simulator.split import RELATIVE_COST, split_worlds


def cost(group: list[str]) -> float:
    return sum(RELATIVE_COST[policy] for policy in group)


def test_two_workers_get_about_equal_shares_of_the_worlds() -> None:
    groups = split_worlds(POLICIES, 2)
    assert sorted(p for group in groups for p in group) == sorted(POLICIES)
    assert len(groups) == 2
    # No other split of the worlds in two is cheaper at its costliest.
    total = cost(list(POLICIES))
    best = max(cost(group) for group in groups)
    for mask in range(1, 2 ** len(POLICIES) - 1):
        one = [p for i, p in enumerate(POLICIES) if mask >> i & 1]
        assert max(cost(one), total - cost(one)) >= best - 1e-9


def test_no_more_groups_than_worlds_or_workers() -> None:
    assert split_worlds(POLICIES, 8) == [[p] for p in POLICIES]
    assert split_worlds(POLICIES, 1) == [list(POLICIES)]
    assert split_worlds(["oracle"], 2) == [["oracle"]]
