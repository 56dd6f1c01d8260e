"""From the region summaries to DNS decisions: targets, shedding state, and client locations.

`Steering` keeps one immutable `SteeringView` per summary index: the targets built from the
summaries and the set of regions shedding clients. When the index moves, the new shedding set is
derived from the previous one (hysteresis) and transitions are logged. Lookups run on the event
loop and never block: everything is in memory.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from control_plane.dns import decision
from control_plane.dns.config import DnsConfig
from control_plane.dns.decision import Decision, ShedMarks, Target
from control_plane.dns.pops import PopHealth
from wire.geo import IPAddress, IPNetwork, Location, locate
from wire.region_summary import RegionSummary, RegionSummaryIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SteeringView:
    index: int
    targets: tuple[Target, ...]
    shedding: frozenset[str]


def ingress_address(ingress_url: str | None) -> IPAddress | None:
    """The ingress URL's host, if it is an IP literal."""
    if ingress_url is None:
        return None
    host = urlsplit(ingress_url).hostname
    if host is None:
        return None
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def target_of(summary: RegionSummary, config: DnsConfig) -> Target:
    configured = config.region_addresses.get(summary.name)
    if configured is not None:
        addresses = tuple(configured)
    else:
        address = ingress_address(summary.ingress_url)
        addresses = (address,) if address is not None else ()
    used = 0.0
    if summary.kv_blocks_total > 0:
        used = 1.0 - summary.kv_blocks_free / summary.kv_blocks_total
    return Target(
        name=summary.name,
        lat=summary.lat,
        lon=summary.lon,
        state=summary.state,
        num_healthy_nodes=summary.healthy_nodes,
        kv_used_share=used,
        queue_delay_s=summary.queue.expected_queue_delay_s,
        addresses=addresses,
    )


def shed_marks(config: DnsConfig, saturation_threshold: float) -> ShedMarks:
    return ShedMarks(
        enter_kv_used_share=saturation_threshold,
        leave_kv_used_share=max(0.0, saturation_threshold - config.leave_kv_margin),
        enter_queue_delay_s=config.enter_queue_delay_s,
        leave_queue_delay_s=config.leave_queue_delay_s,
    )


class Steering:
    """Answers "which region for this client?" from the latest region summaries."""

    def __init__(
        self,
        config: DnsConfig,
        read_summaries: Callable[[], RegionSummaryIndex],
        pops: PopHealth | None = None,
    ):
        self.config = config
        self.pops = pops  # when set, the hostname answers with PoPs instead of regions
        self._read_summaries = read_summaries
        self._locator = config.locator()
        self._default_location = locate(config.default_location)
        self._view = SteeringView(index=-1, targets=(), shedding=frozenset())
        self._unanswerable: frozenset[str] = frozenset()

    def view(self) -> SteeringView:
        summaries = self._read_summaries()
        if summaries.index != self._view.index:
            self._view = self._next_view(summaries)
        return self._view

    def _next_view(self, summaries: RegionSummaryIndex) -> SteeringView:
        targets = tuple(target_of(summary, self.config) for summary in summaries.regions)
        marks = shed_marks(self.config, summaries.routing.saturation_threshold)
        shedding = decision.next_shedding(self._view.shedding, targets, marks)
        for name in sorted(shedding - self._view.shedding):
            logger.warning("DNS: region %s is saturated; shedding part of its clients", name)
        for name in sorted(self._view.shedding - shedding):
            logger.info("DNS: region %s no longer sheds clients", name)
        unanswerable = frozenset(target.name for target in targets if not target.addresses)
        for name in sorted(unanswerable - self._unanswerable):
            logger.warning(
                "DNS: region %s has no answer address (no IP-literal ingress URL, nothing in "
                "dns.region_addresses); it is left out of answers",
                name,
            )
        self._unanswerable = unanswerable
        return SteeringView(index=summaries.index, targets=targets, shedding=shedding)

    def locate(self, network: IPNetwork) -> Location:
        return self._locator.locate(network.network_address) or self._default_location

    def decide(self, network: IPNetwork) -> Decision | None:
        if self.pops is not None:  # PoPs do not shed: the gateways spread load over regions
            client = self.locate(network)
            return decision.choose(client, 0.0, self.pops.targets(), frozenset(), 0.0)
        view = self.view()
        return decision.choose(
            self.locate(network),
            decision.client_hash(network),
            view.targets,
            view.shedding,
            self.config.shed_share,
        )
