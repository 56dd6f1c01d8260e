"""The picker's two views of the nodes' prefix caches against what the caches really hold: the
exact one (region_picker/cache_index.py, fed by the nodes' cache events) and the approximate one
(region_picker/routed_prefixes.py, what the picker itself sent where).

    python -m bench.cache_views [--nodes 3] [--tenants 8] [--system-tokens 1500]
        [--requests 2000] [--pool-blocks 4096 512 256] [--unseen 0.0 0.1] [--seed 0]
        [--json FILE]

A synthetic region without a model: each node is a real KV cache manager (the engine's block
pool and prefix cache, watched) holding up to `--max-running` requests at once; each request is
a tenant's system prompt (salted per tenant) and a question of its own, 20-200 tokens. Every
node's events reach the exact index through the wire schema, in order, as the stream carries
them. Before each request is placed, both views predict, for every node, how many of its leading
blocks the node holds; the truth is what the node's cache holds then. Requests are placed three
ways: at random (a least-request balancer's spread), and by the picker's own scoring
(region_picker/scoring.py `pick`) over each view; an `--unseen` share of them reaches a node at
random without the picker (another way in: a resume, a direct call), which only the exact view
learns of. Prints, per pool size, unseen share and placement, each view's error over all
(request, node) pairs and the share of prompt blocks the chosen nodes really had cached.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from engine.cache_events import CacheEvents
from engine.kv_cache_manager import KVCacheManager, chain_root, hash_block
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence as EngineSequence
from region_picker.cache_index import CacheIndex
from region_picker.routed_prefixes import RoutedPrefixes
from region_picker.scoring import CacheView, Candidate, pick
from wire.cache_events import CacheDelta, CacheSnapshot

BLOCK_SIZE = 16
VOCAB = 49_152


@dataclass(slots=True)
class ViewError:
    """One view's predictions against the truth, over (request, node) pairs."""

    num_pairs: int = 0
    num_exact: int = 0
    blocks_over: int = 0  # predicted held, not held (the costly mistake: a cold prefill)
    blocks_under: int = 0  # held, not predicted (a missed chance)

    def add(self, predicted: int, actual: int) -> None:
        self.num_pairs += 1
        self.num_exact += predicted == actual
        self.blocks_over += max(predicted - actual, 0)
        self.blocks_under += max(actual - predicted, 0)


@dataclass(slots=True)
class RunResult:
    pool_blocks: int
    unseen: float
    placement: str
    exact: ViewError = field(default_factory=ViewError)
    approximate: ViewError = field(default_factory=ViewError)
    prompt_blocks: int = 0
    hit_blocks: int = 0  # of the chosen nodes, really held


class Node:
    """A node's block pool with up to `max_running` requests holding blocks."""

    def __init__(self, node_id: str, num_blocks: int, max_running: int, index: CacheIndex):
        self.node_id = node_id
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        self._max_running = max_running
        self._running: deque[EngineSequence] = deque()
        self._index = index
        self._seq = 0
        snapshot = self.kv.watch_events()
        index.apply_snapshot(
            CacheSnapshot(
                node_id=node_id, block_size=BLOCK_SIZE, seq=0, hashes=_hex(snapshot.stored)
            )
        )

    def held_prefix(self, hashes: Sequence[bytes]) -> int:
        seq = EngineSequence("probe", [], SamplingParams(), 1, cache_salt=None)
        seq.block_hashes = list(hashes)
        seq.token_ids = [0] * (len(hashes) * BLOCK_SIZE + 1)  # no cap on the last block
        return len(self.kv.get_computed_blocks(seq))

    def run(self, request_id: str, tokens: list[int], salt: str) -> None:
        """Admit the request (finishing the oldest while the pool is short), prefill it whole,
        publish its blocks, and stream the changes to the index."""
        seq = EngineSequence(request_id, tokens, SamplingParams(), 1, cache_salt=salt)
        while len(self._running) >= self._max_running:
            self.kv.free(self._running.popleft())
        computed = self.kv.get_computed_blocks(seq)
        num_new = seq.num_tokens - len(computed) * BLOCK_SIZE
        while not self.kv.allocate_slots(seq, num_new, computed):
            self.kv.free(self._running.popleft())
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_full_blocks(seq)
        self._running.append(seq)
        self._publish(self.kv.take_events())

    def candidate(self) -> Candidate:
        return Candidate(
            node_id=self.node_id,
            address=f"{self.node_id}:80",
            block_size=BLOCK_SIZE,
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            num_running=len(self._running),
        )

    def _publish(self, events: CacheEvents | None) -> None:
        if events is None:
            return
        self._seq += 1
        delta = CacheDelta(
            node_id=self.node_id,
            seq=self._seq,
            stored=_hex(events.stored),
            removed=_hex(events.removed),
        )
        assert self._index.apply_delta(delta)


def _hex(hashes: Sequence[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def prompt_blocks(tokens: list[int], salt: str) -> list[bytes]:
    """The prompt's full blocks' hashes, as the picker computes them."""
    hashes: list[bytes] = []
    parent = chain_root(salt)
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block(parent, tokens[start : start + BLOCK_SIZE])
        hashes.append(parent)
    return hashes


def workload(args: argparse.Namespace) -> list[tuple[list[int], str]]:
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(VOCAB) for _ in range(args.system_tokens)] for _ in range(args.tenants)
    ]
    requests = []
    for _ in range(args.requests):
        tenant = rng.randrange(args.tenants)
        question = [rng.randrange(VOCAB) for _ in range(rng.randint(20, 200))]
        requests.append((systems[tenant] + question, f"tenant-{tenant}"))
    return requests


Placement = Callable[[list[Node], list[bytes], CacheIndex, RoutedPrefixes], Node]


def at_random(rng: random.Random) -> Placement:
    return lambda nodes, hashes, exact, approx: rng.choice(nodes)


def by_picker(rng: random.Random, view: str) -> Placement:
    def place(
        nodes: list[Node], hashes: list[bytes], exact: CacheIndex, approx: RoutedPrefixes
    ) -> Node:
        cache: CacheView = exact if view == "exact" else approx
        decision = pick([n.candidate() for n in nodes], hashes, cache, rng)
        assert decision is not None
        return next(n for n in nodes if n.node_id == decision.chosen.candidate.node_id)

    return place


def run(args: argparse.Namespace, pool_blocks: int, unseen: float, placement: str) -> RunResult:
    rng = random.Random(args.seed + 1)
    place = at_random(rng) if placement == "random" else by_picker(rng, placement)
    elsewhere = at_random(random.Random(args.seed + 2))
    exact, approx = CacheIndex(), RoutedPrefixes()
    nodes = [Node(f"node-{i}", pool_blocks, args.max_running, exact) for i in range(args.nodes)]
    result = RunResult(pool_blocks, unseen, placement)
    for number, (tokens, salt) in enumerate(workload(args)):
        hashes = prompt_blocks(tokens, salt)
        for node in nodes:
            actual = node.held_prefix(hashes)
            result.exact.add(exact.cached_prefix_blocks(node.node_id, hashes), actual)
            result.approximate.add(approx.cached_prefix_blocks(node.node_id, hashes), actual)
        if rng.random() < unseen:
            elsewhere(nodes, hashes, exact, approx).run(f"r{number}", tokens, salt)
            continue
        chosen = place(nodes, hashes, exact, approx)
        result.prompt_blocks += len(hashes)
        result.hit_blocks += chosen.held_prefix(hashes)
        approx.record(chosen.node_id, hashes)  # as the picker does for what it sends
        chosen.run(f"r{number}", tokens, salt)
    return result


def row(result: RunResult) -> str:
    cells = [f"{result.pool_blocks:>5}", f"{result.unseen:>6.0%}", f"{result.placement:<11}"]
    for error in (result.exact, result.approximate):
        cells.append(f"{error.num_exact / error.num_pairs:7.1%}")
        cells.append(f"{error.blocks_over / error.num_pairs:7.1f}")
        cells.append(f"{error.blocks_under / error.num_pairs:7.1f}")
    cells.append(f"{result.hit_blocks / result.prompt_blocks:7.1%}")
    return " ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--pool-blocks", type=int, nargs="+", default=[4096, 512, 256])
    parser.add_argument("--unseen", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--max-running", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = [
        run(args, pool, unseen, placement)
        for pool in args.pool_blocks
        for unseen in args.unseen
        for placement in ("random", "approximate", "exact")
    ]
    print(
        " pool unseen placed by    exact: same    over   under approx: same    over   under     hit"
    )
    for result in results:
        print(row(result))
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": [asdict(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
