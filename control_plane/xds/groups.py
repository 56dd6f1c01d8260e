"""What an Envoy is: its role, its region and where it listens, read from its node metadata.

`envoy-bootstrap` writes these into `node.metadata`; the ADS server reads them from the first
request on a stream. Envoys of the same group (say, three ingress Envoys of one region listening on
the same port) share one snapshot.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from enum import StrEnum

from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2

from wire.heartbeat import NAME_PATTERN

ROLE_KEY = "meridian_role"
REGION_KEY = "meridian_region"
LISTEN_HOST_KEY = "meridian_listen_host"
LISTEN_PORT_KEY = "meridian_listen_port"


class Role(StrEnum):
    INGRESS = "ingress"  # a region's front door: balances over that region's node agents
    EDGE = "edge"  # in front of every region: one locality per region


class EnvoyNodeError(ValueError):
    """An Envoy's node description does not say which snapshot it should get."""


@dataclass(frozen=True, slots=True)
class EnvoyGroup:
    role: Role
    region: str | None  # the region an ingress Envoy fronts; None for the edge
    listen_host: str  # an IP literal: Envoy binds listeners to addresses, not names
    listen_port: int

    def __post_init__(self) -> None:
        if (self.region is None) != (self.role is Role.EDGE):
            raise EnvoyNodeError("an ingress Envoy needs a region; an edge Envoy has none")
        if self.region is not None and re.fullmatch(NAME_PATTERN, self.region) is None:
            raise EnvoyNodeError(f"bad region name {self.region!r}")
        try:
            ipaddress.ip_address(self.listen_host)
        except ValueError as exc:
            raise EnvoyNodeError(f"listen host {self.listen_host!r} is not an IP address") from exc
        if not 1 <= self.listen_port <= 65535:
            raise EnvoyNodeError(f"listen port {self.listen_port} is out of range")

    @property
    def label(self) -> str:
        return f"{self.role}/{self.region}" if self.region else str(self.role)

    def covers(self, region: str) -> bool:
        """Whether this Envoy routes to nodes of `region` (an edge Envoy covers them all)."""
        return self.role is Role.EDGE or self.region == region

    def metadata(self) -> dict[str, str | int]:
        values: dict[str, str | int] = {
            ROLE_KEY: str(self.role),
            LISTEN_HOST_KEY: self.listen_host,
            LISTEN_PORT_KEY: self.listen_port,
        }
        if self.region is not None:
            values[REGION_KEY] = self.region
        return values


def _field(metadata: struct_pb2.Struct, key: str) -> struct_pb2.Value | None:
    return metadata.fields.get(key)


def group_of(node: base_pb2.Node) -> EnvoyGroup:
    """Read the group from an Envoy's node metadata; EnvoyNodeError says what is missing."""
    metadata = node.metadata
    role, host, port = (_field(metadata, k) for k in (ROLE_KEY, LISTEN_HOST_KEY, LISTEN_PORT_KEY))
    if role is None or host is None or port is None:
        raise EnvoyNodeError(
            f"node {node.id!r} lacks {ROLE_KEY}/{LISTEN_HOST_KEY}/{LISTEN_PORT_KEY} metadata "
            "(bootstrap it with `python -m control_plane envoy-bootstrap`)"
        )
    try:
        role_value = Role(role.string_value)
    except ValueError as exc:
        raise EnvoyNodeError(f"unknown role {role.string_value!r}") from exc
    region = _field(metadata, REGION_KEY)
    port_value = port.number_value
    if not port.HasField("number_value") or port_value != int(port_value):
        raise EnvoyNodeError(f"{LISTEN_PORT_KEY} must be a whole number")
    return EnvoyGroup(
        role=role_value,
        region=region.string_value if region is not None else None,
        listen_host=host.string_value,
        listen_port=int(port_value),
    )
