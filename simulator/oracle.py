"""The clairvoyant policies that read the nodes themselves: `oracle`, `oracle_spread` and
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

# The near-best band of `oracle_spread`, as wide as the gateway's default `p2c_tolerance`.
ORACLE_SPREAD: Final = 0.2


class OracleChooser(Chooser):
    """Every node's true queue now, plus what this oracle already sent that is still on the
    wire to it (so that it does not herd within one RTT). `is_direct`: the oracle stands in the
    client, not in its PoP: it sends over the client's own public path, straight to the region
    (the way `nearest`'s clients go), with the gateway's rules for attempts, fallbacks and
    resumes; on a calm day a client near a region may reach it sooner than through a PoP."""

    needs_control_plane = False  # it reads the nodes themselves

    def __init__(
        self,
        sites: Mapping[str, Site],
        geography: Geography,
        spread: float = 0.0,
        is_direct: bool = False,
    ) -> None:
        self.sites = sites
        self.geography = geography
        self.spread = spread
        self.is_via_pop = not is_direct
        self._rtt_s: dict[tuple[str, str], float] = {}  # (PoP or client city, region)
        self._on_the_way: list[tuple[float, int, str, int]] = []  # heap: arrival, seq, node, tokens
        self._incoming: dict[str, tuple[int, int]] = {}  # node → (requests, prompt tokens)
        self._sequence = itertools.count()

    def rtt_s(self, pop: str, city: str, site: Site) -> float:
        """The true RTT to `site` from the PoP, or, for a direct oracle, from the client's city
        over its public path (its jitter and loss left out)."""
        origin = pop if self.is_via_pop else city
        key = (origin, site.name)
        rtt_s = self._rtt_s.get(key)
        if rtt_s is None:
            geography = self.geography
            if self.is_via_pop:
                rtt_ms = geography.true_rtt_ms(geography.pops[pop], site.location)
            else:
                rtt_ms = geography.true_rtt_ms(
                    geography.cities[city], site.location, is_public=True
                )
            rtt_s = self._rtt_s[key] = rtt_ms / 1000.0
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
            rtt_s = self.rtt_s(pop, request.city, site)
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
            arrive_s = now_s + self.rtt_s(pop, request.city, self.sites[first.region]) / 2.0
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
