"""The edge tier: a small node beside a PoP's gateway that answers light `auto` requests.

A share of the requests name the model alias `auto`; at a PoP with an edge node the gateway's
own classifier (`gateway/tiers.py`) sends the light ones to the edge and the rest, and all of
them while the edge is saturated (`max_concurrency` of this PoP's requests on it, as
`gateway/edge.py` counts) or down, to a region. An edge attempt that fails before its first byte
(the node's queue is full) falls back to the regions within the same request and deadline, as
in `gateway/edge.py`. A request asks for exactly its output length, so `max_tokens` is that.

The edge node is the regions' service model with its own calibration (`EDGE_CALIBRATION`: the
same engine and model, a smaller machine: fewer sequences and KV blocks), one hop from the
gateway. Policies that send clients straight to a region (`nearest`) pass no PoP, so no edge.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from gateway.settings import GatewaySettings
from gateway.tiers import EdgeThresholds, TierChoice, classify
from simulator.calibration import ServiceCalibration
from simulator.models import DEFAULT_MODEL
from simulator.site import Site
from simulator.workload import Request

_DEFAULTS = GatewaySettings.model_fields

EDGE_CALIBRATION: Final = ServiceCalibration(max_num_seqs=8, kv_blocks=512)
DEFAULT_AUTO_SHARE: Final = 0.5
DEFAULT_MAX_CONCURRENCY: Final = int(_DEFAULTS["edge_max_concurrency"].default)
POP_TO_EDGE_MS: Final = 0.5  # one way: the edge stands in the PoP's building


def default_edge_thresholds() -> EdgeThresholds:
    return EdgeThresholds(
        int(_DEFAULTS["edge_max_prompt_tokens"].default), int(_DEFAULTS["edge_max_tokens"].default)
    )


@dataclass(frozen=True, slots=True)
class EdgeSpec:
    pops: tuple[str, ...] | None = None  # the PoPs with an edge node (None: every PoP)
    auto_share: float = DEFAULT_AUTO_SHARE  # of the requests, sent for the model alias `auto`
    thresholds: EdgeThresholds = field(default_factory=default_edge_thresholds)
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    calibration: ServiceCalibration = EDGE_CALIBRATION

    def __post_init__(self) -> None:
        if not 0.0 <= self.auto_share <= 1.0:
            raise ValueError(f"auto_share must be within 0-1, not {self.auto_share}")


def auto_requests(spec: EdgeSpec, requests: Sequence[Request], seed: int) -> frozenset[int]:
    """The ids of the requests sent as `auto` (seeded apart from the workload's own draws): of
    those for the default model, the one the edge serves."""
    rng = random.Random(f"auto/{seed}")
    return frozenset(
        r.request_id
        for r in requests
        if rng.random() < spec.auto_share and r.model == DEFAULT_MODEL
    )


class EdgeTier:
    """Every PoP's edge site and the gateway's count of its requests in flight there."""

    def __init__(self, spec: EdgeSpec, sites: Mapping[str, Site], auto_ids: frozenset[int]):
        self.spec = spec
        self.sites = sites  # PoP → its edge site
        self.auto_ids = auto_ids
        self.in_flight = dict.fromkeys(sites, 0)

    def is_auto(self, request: Request) -> bool:
        return request.request_id in self.auto_ids

    def choose(self, pop: str, request: Request) -> TierChoice | None:
        """The classifier's tier for `request` at `pop` (None: not `auto`, or no edge there)."""
        site = self.sites.get(pop)
        if site is None or request.request_id not in self.auto_ids:
            return None
        return classify(
            request.prompt_tokens,
            request.output_tokens,
            self.spec.thresholds,
            is_edge_up=site.is_up and any(node.is_up for node in site.nodes),
            is_edge_saturated=self.in_flight[pop] >= self.spec.max_concurrency,
        )


def edge_site_name(pop: str) -> str:
    return f"edge-{pop}"
