"""The clairvoyant policies that read the world itself: `oracle`, `oracle_spread` and
`oracle_direct` (simulator/policies.py lists every policy)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Mapping
from typing import Final

from simulator.node import Node
from simulator.policies import Chooser, Pick
from simulator.site import Site
from simulator.workload import Request
from simulator.world import Geography

# The near-best band of `oracle_spread`: the gateway's `p2c_tolerance` when it was measured
# (2026-12-05; the gateway's is 0.05 since 2026-12-06).
ORACLE_SPREAD: Final = 0.2


class OracleChooser(Chooser):
    """Every node's true queue now, plus what this oracle already sent that is still on the
    wire to it (so that it does not herd within one RTT)."""

    needs_control_plane = False  # it reads the nodes themselves

    def __init__(
        self, sites: Mapping[str, Site], geography: Geography, spread: float = 0.0
    ) -> None:
        self.sites = sites
        self.geography = geography
        self.spread = spread
        self._rtt_s: dict[tuple[str, str], float] = {}
        self._on_the_way: list[tuple[float, int, str, int]] = []  # heap: arrival, seq, node, tokens
        self._incoming: dict[str, tuple[int, int]] = {}  # node → (requests, prompt tokens)
        self._sequence = itertools.count()

    def rtt_s(self, pop: str, site: Site) -> float:
        key = (pop, site.name)
        rtt_s = self._rtt_s.get(key)
        if rtt_s is None:
            here = self.geography.pops[pop]
            rtt_s = self._rtt_s[key] = self.geography.true_rtt_ms(here, site.location) / 1000.0
        return rtt_s

    def _arrived_by(self, now_s: float) -> None:
        heap = self._on_the_way
        while heap and heap[0][0] <= now_s:
            _, _, name, tokens = heapq.heappop(heap)
            num, total = self._incoming[name]
            self._incoming[name] = (num - 1, total - tokens)

    def order(
        self, pop: str, request: Request, now_s: float, limit: int, exclude: Collection[str] = ()
    ) -> list[Pick]:
        self._arrived_by(now_s)
        model = request.model
        picks = []
        # Once per request, not once per node (`affinity_key` and `prefix_tokens` are properties).
        prompt_tokens = request.prompt_tokens
        key, prefix_tokens = request.affinity_key, request.prefix_tokens
        incoming = self._incoming
        for site in self.sites.values():
            if not site.is_up or site.name in exclude:
                continue
            rtt_s = self.rtt_s(pop, site)
            best: tuple[float, Node] | None = None
            for node in site.serving.get(model, ()):
                if not node.is_up:
                    continue
                num, tokens = incoming.get(node.name, (0, 0))
                ttft_s = node.predict_ttft_s(prompt_tokens, key, prefix_tokens, now_s, num, tokens)
                if best is None or ttft_s < best[0]:
                    best = (ttft_s, node)
            if best is not None:
                picks.append(Pick(site.name, rtt_s + best[0], best[1]))
        picks.sort(key=lambda pick: pick.predicted_ttft_s)
        if picks and self.spread > 0.0:
            picks = self._spread(picks)
        if picks:  # the first is sent now: it reaches its node half an RTT from now
            first, target = picks[0], picks[0].node
            assert target is not None
            arrive_s = now_s + self.rtt_s(pop, self.sites[first.region]) / 2.0
            entry = (arrive_s, next(self._sequence), target.name, request.prompt_tokens)
            heapq.heappush(self._on_the_way, entry)
            num, tokens = self._incoming.get(target.name, (0, 0))
            self._incoming[target.name] = (num + 1, tokens + request.prompt_tokens)
        return picks[:limit]

    def _spread(self, picks: list[Pick]) -> list[Pick]:
        """`picks` (by predicted TTFT) with the first chosen among the near-best (within
        `spread` of the best) as the one whose node has the fewest requests not started yet,
        those on their way to it included: a surge spread before queues show it."""
        limit_s = picks[0].predicted_ttft_s * (1.0 + self.spread)
        near = [pick for pick in picks if pick.predicted_ttft_s <= limit_s]
        if len(near) == 1:
            return picks

        def waiting(pick: Pick) -> tuple[int, float]:
            assert pick.node is not None
            num_incoming = self._incoming.get(pick.node.name, (0, 0))[0]
            return pick.node.num_not_started + num_incoming, pick.predicted_ttft_s

        chosen = min(near, key=waiting)
        return [chosen, *(pick for pick in picks if pick is not chosen)]


class DirectOracleChooser(Chooser):
    """`nearest` made clairvoyant: the client goes straight to the region its own public path
    reaches soonest (the true RTT, not a DNS answer cached for its TTL) among those up with a
    node up serving the model, where the region's picker chooses the node; with the gateway's
    rules for attempts, fallbacks and resumes. On a calm day with fast nodes the path is most of
    a TTFT, and a client near a region reaches it sooner than through a PoP and the backbone. (A
    direct oracle that chose the node by its predicted TTFT, as `oracle` does, lost to `nearest`
    at p99 by herding onto the nodes that held a prompt: docs/simulator.md.)"""

    is_via_pop = False
    needs_control_plane = False

    def __init__(self, sites: Mapping[str, Site], geography: Geography) -> None:
        self.sites = sites
        self.geography = geography
        self._by_rtt: dict[str, list[tuple[float, Site]]] = {}  # by city, nearest first

    def by_rtt(self, city: str) -> list[tuple[float, Site]]:
        """Every region with the true RTT of the city's public path to it, nearest first."""
        ranked = self._by_rtt.get(city)
        if ranked is None:
            geography, here = self.geography, self.geography.cities[city]
            ranked = sorted(
                (
                    (geography.true_rtt_ms(here, site.location, is_public=True) / 1000.0, site)
                    for site in self.sites.values()
                ),
                key=lambda ranked_site: ranked_site[0],
            )
            self._by_rtt[city] = ranked
        return ranked

    def order(
        self, pop: str, request: Request, now_s: float, limit: int, exclude: Collection[str] = ()
    ) -> list[Pick]:
        picks = []
        for rtt_s, site in self.by_rtt(request.city):
            if not site.is_up or site.name in exclude:
                continue
            if any(node.is_up for node in site.serving.get(request.model, ())):
                picks.append(Pick(site.name, rtt_s))
                if len(picks) == limit:
                    break
        return picks
