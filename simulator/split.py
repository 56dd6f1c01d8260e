"""Which worker process runs which policies' worlds, so that the workers finish together.

A world's CPU time depends mostly on its policy (the same traffic, the same scenario), so each
policy has a relative cost, measured on `steady` (docs/simulator.md, "Wall time"). The worlds
are split into `jobs` groups that minimise the costliest group: with at most eight policies
every assignment can be tried. (A pool that hands each world to the first worker free, even
costliest first, can leave one worker with a world to run alone at the end.)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Final

# CPU seconds of one world relative to `round_robin`'s (steady, seed 0, 100,000 requests, one
# world a process, ~1.5 s of start-up taken off each; EPYC, 2026-12-07: `round_robin` 20.9 s,
# `meridian` 30.0, `oracle_meridian` 105.8).
RELATIVE_COST: Final[Mapping[str, float]] = {
    "meridian": 1.47,
    "least_loaded": 0.96,
    "round_robin": 1.0,
    "oracle": 0.43,
    "oracle_spread": 0.43,
    "oracle_direct": 0.37,  # no control plane, no prediction
    "nearest": 1.01,
    "oracle_meridian": 5.39,  # its nodes beat 20 times a second
}
UNKNOWN_COST = 1.0


def split_worlds(policies: Sequence[str], jobs: int) -> list[list[str]]:
    """At most `jobs` non-empty groups of `policies` (each once, in their given order within a
    group), the costliest group as cheap as it can be; ties keep the earlier assignment."""
    costs = [RELATIVE_COST.get(policy, UNKNOWN_COST) for policy in policies]
    num_groups = max(1, min(jobs, len(policies)))
    if num_groups == len(policies):
        return [[policy] for policy in policies]
    best: tuple[int, ...] = ()
    best_cost = float("inf")
    for assignment in itertools.product(range(num_groups), repeat=len(policies)):
        totals = [0.0] * num_groups
        for group, cost in zip(assignment, costs, strict=True):
            totals[group] += cost
        if max(totals) < best_cost:
            best, best_cost = assignment, max(totals)
    groups: list[list[str]] = [[] for _ in range(num_groups)]
    for policy, group in zip(policies, best, strict=True):
        groups[group].append(policy)
    return [group for group in groups if group]
