"""Gateways at several PoPs sharing keys' limits through the control plane: waiting until each
has the key and holds its even part of every key."""

from __future__ import annotations

import pytest
from gw_fleet import Fleet, GatewayThread, wait_until

from gateway.limit_shares import PopLimiter


def limiter_of(gateway: GatewayThread) -> PopLimiter:
    limiter = gateway.handlers.limiter
    assert isinstance(limiter, PopLimiter)
    return limiter


def wait_for_even_shares(fleet: Fleet, gateways: list[GatewayThread]) -> None:
    """Until every gateway sees the regions and has the keys, and, the PoPs having joined one
    after another, holds an even part of every key."""
    for gateway in gateways:
        fleet.wait_for_gateway(gateway)
        wait_until(lambda g=gateway: len(g.handlers.keys) > 0, what="the key")
    even = 1 / len(gateways)
    for gateway in gateways:
        shares = limiter_of(gateway).shares
        wait_until(lambda s=shares: s.default_share == pytest.approx(even), 10.0, "shares")
