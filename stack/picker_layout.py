"""Where a region's endpoint picker (region_picker/) listens, and how the others reach it.

Region i's picker: ext_proc on `picker_base + i` (its Envoy asks it, told over xDS by the control
plane, where `up` registers it as the region's `picker` field), /metrics on `picker_metrics_base +
i`, and the cache event streams of the region's node agents (their `--picker-url`) on
`picker_events_base + i`. Only a region with an ingress Envoy can have one: Envoy is what asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from stack.config import StackConfig
from stack.errors import StackError


@dataclass(frozen=True, slots=True)
class PickerLayout:
    host: str
    port: int  # ext_proc (gRPC)
    metrics_port: int
    cache_events_port: int

    @property
    def address(self) -> str:
        """`IP:PORT`, as the control plane's region field `picker` takes it."""
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def cache_events_url(self) -> str:
        """The node agents' `--picker-url`."""
        return f"ws://{self.host}:{self.cache_events_port}"

    def tcp_ports(self, region: str) -> list[tuple[int, str]]:
        return [
            (self.port, f"picker {region}"),
            (self.metrics_port, f"picker {region} metrics"),
            (self.cache_events_port, f"picker {region} cache events"),
        ]


def plan_picker(config: StackConfig, i: int, host: str, use_envoy: bool) -> PickerLayout | None:
    """Region i's picker, None if it has none; StackError if it wants one without Envoy."""
    region = config.regions[i]
    if not config.has_picker(region):
        return None
    if not use_envoy:
        raise StackError(
            f"region {region.name} has a picker, which only its Envoy can ask: use Envoy "
            "(`envoy: auto` or `on`; `pip install 'meridian[envoy]'`), or set `picker: off`"
        )
    ports = config.ports
    return PickerLayout(
        host, ports.picker_base + i, ports.picker_metrics_base + i, ports.picker_events_base + i
    )
