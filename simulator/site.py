"""A region's datacenter in the simulation: its nodes behind one ingress.

The ingress is the region's Envoy with the control plane's config (control_plane/xds): it sends
a request to the live node with the fewest requests in flight (least-request with equal
weights), and a node that deflects the attempt (wire/deflection.py: another request there is
still waiting for its first token, but not a deep queue) makes it try the least-loaded node not
tried yet, as Envoy's retry with the previous-hosts predicate does. The retry's in-region hop
(about a millisecond, Envoy's back-off included) is not charged. With the region picker
(simulator/node_picker.py) the picker names the node instead, and Envoy's least request is only
its fallback. A region that is down answers nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from simulator.node import Job, Node
from simulator.node_picker import DEFLECTED, Named, NodePicker
from wire.deflection import DEFAULT_DEFLECT_AT_WAITING, should_deflect
from wire.geo import Location


class Refusal(enum.Enum):
    """Why an attempt arriving at a region is not taken by a node there."""

    DARK = "dark"  # the region, or every node it would route to, is down: no connect
    NO_ROUTE = "no_route"  # no node here serves the model: the ingress answers 404
    FULL = "full"  # the node's queue is full, or the request can never fit it: 429
    DEFLECTED = "deflected"  # the picker sent it back to its gateway: 429


@dataclass(slots=True)
class Site:
    name: str
    location: Location
    ingress_url: str
    nodes: list[Node]
    is_up: bool = True
    deflect_at_waiting: int = DEFAULT_DEFLECT_AT_WAITING  # the node agents' setting
    num_deflected: int = 0
    serving: dict[str, list[Node]] = field(default_factory=dict)  # model → its nodes here
    picker: NodePicker | None = None  # the region picker (None: Envoy's least request alone)

    def __post_init__(self) -> None:
        for node in self.nodes:
            self.serving.setdefault(node.model, []).append(node)

    def _least_loaded(self, nodes: list[Node], tried: list[Node]) -> Node | None:
        best: Node | None = None
        best_load = 0
        for node in nodes:
            if node.is_up and node not in tried:
                load = node.num_in_flight
                if best is None or load < best_load:
                    best, best_load = node, load
        return best

    def is_serving(self, model: str) -> bool:
        """Whether any node here serves `model` (else its ingress has no route for it)."""
        return model in self.serving

    def pick_node(
        self, model: str, job: Job, now_s: float, alternative_s: float | None = None
    ) -> Named:
        """The node serving `model` that takes `job`, arriving now (None: no such node is
        up; DEFLECTED: the picker sent it back, `alternative_s` being sooner)."""
        nodes = self.serving.get(model, [])
        if self.picker is not None:
            return self.picker.pick(nodes, job, now_s, alternative_s)
        tried: list[Node] = []
        attempt = 1
        while True:
            node = self._least_loaded(nodes, tried)
            if node is None:  # every live node was tried: Envoy's plain pick, not deflected
                return self._least_loaded(nodes, [])
            if not should_deflect(node.num_not_started, attempt, self.deflect_at_waiting):
                return node
            self.num_deflected += 1
            tried.append(node)
            attempt += 1

    def take(
        self, model: str, job: Job, now_s: float, node: Node | None, alternative_s: float | None
    ) -> Node | Refusal:
        """The node that takes `job`, arriving now (`node`: the one a policy named, else the
        ingress chooses), or why none does."""
        named: Named = node
        if named is None:
            named = self.pick_node(model, job, now_s, alternative_s)
        if named is DEFLECTED:
            return Refusal.DEFLECTED
        if not self.is_up or named is None or not named.is_up:
            return Refusal.NO_ROUTE if self.is_up and not self.is_serving(model) else Refusal.DARK
        if named.is_overloaded() or not named.can_ever_fit(job):
            return Refusal.FULL
        return named
