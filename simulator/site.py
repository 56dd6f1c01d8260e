"""A region's datacenter in the simulation: its nodes behind one ingress.

The ingress sends each request to the live node with the fewest requests in flight (what an
Envoy least-request balancer does with equal weights); a region that is down answers nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.node import Node
from wire.geo import Location


@dataclass(slots=True)
class Site:
    name: str
    location: Location
    ingress_url: str
    nodes: list[Node]
    is_up: bool = True

    def pick_node(self) -> Node | None:
        best: Node | None = None
        best_load = 0
        for node in self.nodes:
            if node.is_up:
                load = node.num_in_flight
                if best is None or load < best_load:
                    best, best_load = node, load
        return best
