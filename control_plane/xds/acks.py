"""What a wait for Envoys' ACKs asks (`XdsServer.wait_for_ack`, `.lagging`) and how it ends.

A condition is a type URL (every Envoy has ACKed the current version of that type) or a predicate
over the resources an Envoy has ACKed (a drain's: no assignment lists the node any more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from control_plane.xds.plan import upstream_address
from control_plane.xds.snapshot import Resources

AckCondition = str | Callable[[Resources], bool]


@dataclass(frozen=True, slots=True)
class AckWait:
    """How a `wait_for_ack` ended: complete, or the Envoys that had not caught up in time."""

    is_complete: bool
    num_envoys: int
    lagging: tuple[str, ...] = ()


def lacks_endpoint(url: str) -> Callable[[Resources], bool]:
    """A condition for `wait_for_ack`: no assignment lists the node serving `url`."""
    address = upstream_address(url)

    def is_met(resources: Resources) -> bool:
        for assignment in resources.by_name.values():
            for group in getattr(assignment, "endpoints", ()):
                for lb_endpoint in group.lb_endpoints:
                    socket = lb_endpoint.endpoint.address.socket_address
                    if (socket.address, socket.port_value) == address:
                        return False
        return True

    return is_met
