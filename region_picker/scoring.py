"""Which node a request goes to: pure scoring over the nodes' cached prefixes and load.

Each candidate's cost is the work ahead of the request there, in prompt tokens:
- the prompt tokens it would prefill (those past its cached prefix of the prompt's blocks),
- the prefill tokens already ahead of it: waiting, admitted and not yet computed, and those the
  picker sent it lately, which its report (a heartbeat and a sweep behind) may not count yet,
- a step for its own first token and one for each request waiting, or sent there by the picker
  and not yet answered (the node's report, up to a sweep old, may not count those yet), at the
  step time the node measures, in the tokens it prefills in that time: a node of slow steps (a
  slower type, or a big batch: each running sequence lengthens a step) costs a short prompt
  more than its prefill rate says. Where no step time is measured yet, a request's worth of
  tokens for each request ahead and a smaller share for each running one stand in for it,
all scaled up once its KV cache is fuller than KV_KNEE (a node short of blocks evicts the very
prefixes that make it cheap, and preempts), and by how much slower than the candidates' mean
prefill rate it reports (unlike nodes in one region: work ahead of a node twice as fast costs
half as long; a node that reports no rate or step time is taken at the mean). The simulator
chose these (docs/simulator.md, `mixed_hardware`). The cheapest wins; of the near ties (within
`NEAR_TIE`) those holding the most of the prompt stay (a node that would prefill it again is no
sooner for this request and costs the region the work), and of those two are drawn at random and
the less busy of the two wins, so that one hot prefix spreads over the nodes that hold it
instead of piling onto one. A request whose gateway says what its next-best region costs goes
back to the gateway when the winner is further from a first token than that (`deflects`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

# Where no step time is measured: what a queued request costs a new one, in prompt tokens
# (about a typical prompt's prefill), and what a running one costs (its decodes share the
# batch's steps): a fraction of that.
WAITING_REQUEST_TOKENS: Final = 256
RUNNING_REQUEST_TOKENS: Final = 32
# KV use up to this share costs nothing; past it the cost rises to twice at a full cache.
KV_KNEE: Final = 0.7
# Costs within this fraction of the best (or NEAR_TIE_TOKENS of it) are ties.
NEAR_TIE: Final = 0.1
NEAR_TIE_TOKENS: Final = 64


class CacheView(Protocol):
    """What the picker knows of the nodes' prefix caches."""

    def cached_prefix_blocks(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks `node_id` holds."""
        ...


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that serves the request's model, as last reported, plus the picker's own sends."""

    node_id: str
    address: str  # host:port, what Envoy's original-destination cluster connects to
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_prefill_tokens: int = 0
    num_running_prefill_tokens: int = 0
    num_sent_prefill_tokens: int = 0  # sent by the picker lately: maybe not in the report yet
    num_pending: int = 0  # requests the picker sent it whose response has not started
    prefill_tokens_per_s: float | None = None  # as it measures it (None: not measured yet)
    step_s: float | None = None  # a step's time besides its prompt tokens, the same way

    @property
    def num_busy(self) -> int:
        return self.num_running + self.num_waiting + self.num_pending


@dataclass(frozen=True, slots=True)
class Scored:
    candidate: Candidate
    cached_blocks: int
    cost: float


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: Scored
    scored: tuple[Scored, ...]  # every candidate, in the order given
    # The chosen node's cost in seconds, its work ahead at its own rate: about how long until
    # the request's first token there (None: no candidate has measured its rate yet).
    wait_s: float | None = None

    @property
    def cached_tokens(self) -> int:
        return self.chosen.cached_blocks * self.chosen.candidate.block_size


def deflects(decision: Decision, alternative_s: float | None) -> bool:
    """Whether the request goes back to its gateway (wire/deflection.py): the node chosen is
    further from a first token than the gateway's next-best region, as the gateway costed it.
    Both count from the region on: the trip here and back again is spent either way."""
    wait_s = decision.wait_s
    return alternative_s is not None and wait_s is not None and wait_s > alternative_s


def score(
    candidate: Candidate,
    num_blocks: int,
    cached_blocks: int,
    mean_rate: float | None = None,
    mean_step_s: float | None = None,
) -> float:
    """The candidate's cost for a prompt of `num_blocks` full blocks, `cached_blocks` of them
    cached there (the partial last block is prefilled everywhere and left out), in prompt tokens
    at `mean_rate` (the candidates' mean prefill rate; None: rates left out). `mean_step_s`: the
    candidates' mean step time, for one that has measured none."""
    uncached = (num_blocks - cached_blocks) * candidate.block_size
    queued = candidate.num_waiting + candidate.num_pending
    work: float = (
        uncached
        + candidate.num_waiting_prefill_tokens
        + candidate.num_running_prefill_tokens
        + candidate.num_sent_prefill_tokens
    )
    rate = candidate.prefill_tokens_per_s or mean_rate
    step_s = candidate.step_s or mean_step_s
    if rate is None or step_s is None:
        work += WAITING_REQUEST_TOKENS * queued + RUNNING_REQUEST_TOKENS * candidate.num_running
    else:
        work += step_s * rate * (queued + 1)
    total = max(candidate.kv_blocks_total, 1)
    used = 1.0 - min(candidate.kv_blocks_free, total) / total
    pressure = max(0.0, used - KV_KNEE) / (1.0 - KV_KNEE)
    slowness = 1.0 if mean_rate is None or rate is None else mean_rate / rate
    return work * (1.0 + pressure) * slowness


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def pick(
    candidates: Sequence[Candidate],
    block_hashes: Sequence[bytes],
    cache: CacheView,
    rng: random.Random,
) -> Decision | None:
    """The best candidate for a prompt with these block hashes; None if there is none."""
    if not candidates:
        return None
    scored = []
    mean_rate = _mean([c.prefill_tokens_per_s for c in candidates])
    mean_step_s = _mean([c.step_s for c in candidates])
    for candidate in candidates:
        cached = cache.cached_prefix_blocks(candidate.node_id, block_hashes) if block_hashes else 0
        cost = score(candidate, len(block_hashes), cached, mean_rate, mean_step_s)
        scored.append(Scored(candidate, cached, cost))
    best = min(s.cost for s in scored)
    ties = [s for s in scored if s.cost <= best + max(best * NEAR_TIE, NEAR_TIE_TOKENS)]
    # Of near ties, those holding the most of the prompt: as soon for this request, and the
    # region computes (and caches again) no more than it must.
    most = max(s.cached_blocks for s in ties)
    ties = [s for s in ties if s.cached_blocks == most]
    if len(ties) == 1:
        chosen = ties[0]
    else:
        first, second = rng.sample(ties, 2)
        chosen = min((first, second), key=lambda s: (s.candidate.num_busy, s.cost))
    # A cost is in prompt tokens at the mean rate (`score`).
    wait_s = None if mean_rate is None else chosen.cost / mean_rate
    return Decision(chosen, tuple(scored), wait_s)
