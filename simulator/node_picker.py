"""The region picker (region_picker/) inside a simulated region: which node takes a request,
chosen by the picker's own scoring (region_picker/scoring.py, imported, not copied).

The real picker knows each node's prefix cache exactly (the nodes stream their cache events to
it) and its load from the control plane's reports plus its own sends not yet answered; here it
is handed the same things as they are now: each node's true queue and free KV blocks, and which
tenants' system prompts it holds. The simulated nodes cache whole system prompts only
(simulator/node.py), so a prompt's blocks are its system prompt's, keyed by tenant, then blocks
no node ever holds. A request the picker names goes to that node through Envoy's
original-destination route, which has no other host to retry: the node takes it (no node
deflects), unless the picker itself sends it back to its gateway (wire/deflection.py).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from typing import Final, Literal

from region_picker.scoring import Candidate, deflects, pick
from simulator.node import Job, Node


class Deflected(enum.Enum):
    DEFLECTED = "deflected"


DEFLECTED: Final = Deflected.DEFLECTED  # the picker sent the request back to its gateway
Named = Node | Literal[Deflected.DEFLECTED] | None

_UNCACHED = b""  # a block past the system prompt: never in any node's cache


class TenantBlocks:
    """A `CacheView` over the simulated nodes: the first block's hash names its tenant."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self._nodes = {node.name: node for node in nodes}
        self._prefix_of: dict[bytes, tuple[str, int]] = {}  # first block → (tenant, its blocks)
        self._blocks_of: dict[tuple[str, int], list[bytes]] = {}

    def block_hashes(self, job: Job, block_size: int) -> list[bytes]:
        """The hashes of `job`'s full prompt blocks, its system prompt's first."""
        num_blocks = job.prompt_tokens // block_size
        if job.prefix_key is None:
            return [_UNCACHED] * num_blocks
        num_prefix = min(job.prefix_tokens // block_size, num_blocks)
        key = (job.prefix_key, num_prefix)
        prefix = self._blocks_of.get(key)
        if prefix is None:
            prefix = [f"{job.prefix_key}/{i}".encode() for i in range(num_prefix)]
            self._blocks_of[key] = prefix
            if prefix:
                self._prefix_of[prefix[0]] = key
        return prefix + [_UNCACHED] * (num_blocks - num_prefix)

    def cached_prefix_blocks(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        key = self._prefix_of.get(block_hashes[0]) if block_hashes else None
        if key is None or key[0] not in self._nodes[node_id].prefix_cache:
            return 0
        return key[1]


class NodePicker:
    """The picker of one region; `rng` breaks its near ties, as the real one's does."""

    def __init__(self, nodes: Sequence[Node], rng: random.Random) -> None:
        self._cache = TenantBlocks(nodes)
        self._rng = rng

    def pick(
        self, nodes: Sequence[Node], job: Job, now_s: float, alternative_s: float | None = None
    ) -> Named:
        """The node of `nodes` (those serving the request's model) the picker names; None if
        none is up; DEFLECTED if it sends the request back, none of them being sooner than
        `alternative_s`, the next-best region as its gateway costs it."""
        live = [node for node in nodes if node.is_up]
        if not live:
            return None
        candidates = [_candidate(node, now_s) for node in live]
        hashes = self._cache.block_hashes(job, candidates[0].block_size)
        decision = pick(candidates, hashes, self._cache, self._rng)
        assert decision is not None
        if deflects(decision, alternative_s):
            return DEFLECTED
        index = candidates.index(decision.chosen.candidate)
        return live[index]


def _candidate(node: Node, now_s: float) -> Candidate:
    load = node.load(now_s)
    calibration = node.calibration
    return Candidate(
        node_id=node.name,
        address="",
        block_size=calibration.block_size,
        kv_blocks_total=calibration.kv_blocks,
        kv_blocks_free=load.kv_blocks_free,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_waiting_prefill_tokens=load.num_waiting_prefill_tokens,
        num_running_prefill_tokens=load.num_running_prefill_tokens,
        prefill_tokens_per_s=calibration.prefill_tokens_per_s,
        step_s=calibration.step_s(load.num_running),  # what its engine would measure now
    )
