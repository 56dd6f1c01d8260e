"""Immutable, versioned snapshots: every resource an Envoy group gets, by type.

A type's version is a hash of its content (names and deterministic serialization), so it is the
same for the same content and different for different content across control-plane restarts;
Envoy reports the versions it holds when it reconnects, and a counter restarting at 1 would make
old and new configurations look alike. Resources are packed into `Any` once, when the snapshot is
built; nothing mutates them afterwards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from control_plane.xds.picker import add_picker
from control_plane.xds.plan import EnvoyPlan
from control_plane.xds.resources import pack, resource_name, resources_of
from control_plane.xds.validation import snapshot_violations

VERSION_LEN = 16


class InvalidSnapshotError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def content_version(type_url: str, messages: Iterable[Message]) -> str:
    digest = hashlib.sha256(type_url.encode())
    for message in sorted(messages, key=resource_name):
        name = resource_name(message).encode()
        body = message.SerializeToString(deterministic=True)
        digest.update(len(name).to_bytes(4, "big") + name + len(body).to_bytes(8, "big") + body)
    return digest.hexdigest()[:VERSION_LEN]


@dataclass(frozen=True, slots=True)
class Resources:
    """One type's resources in a snapshot (or the part of them one response carried)."""

    type_url: str
    version: str
    by_name: Mapping[str, Message] = field(default_factory=lambda: MappingProxyType({}))
    packed: Mapping[str, any_pb2.Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, type_url: str, messages: Iterable[Message]) -> Resources:
        items = sorted(messages, key=resource_name)
        return cls(
            type_url=type_url,
            version=content_version(type_url, items),
            by_name=MappingProxyType({resource_name(m): m for m in items}),
            packed=MappingProxyType({resource_name(m): pack(m) for m in items}),
        )

    def select(self, names: Iterable[str] | None) -> Resources:
        """The named resources (all when `names` is None), under the same version."""
        if names is None:
            return self
        wanted = [name for name in names if name in self.by_name]
        return Resources(
            type_url=self.type_url,
            version=self.version,
            by_name=MappingProxyType({name: self.by_name[name] for name in wanted}),
            packed=MappingProxyType({name: self.packed[name] for name in wanted}),
        )

    def response(self, nonce: str) -> discovery_pb2.DiscoveryResponse:
        return discovery_pb2.DiscoveryResponse(
            version_info=self.version,
            resources=list(self.packed.values()),
            type_url=self.type_url,
            nonce=nonce,
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    by_type: Mapping[str, Resources]

    @classmethod
    def of(cls, resources: Mapping[str, Iterable[Message]]) -> Snapshot:
        """A snapshot of these resources, unchecked (`build_snapshot` checks them first)."""
        return cls(MappingProxyType({t: Resources.of(t, m) for t, m in resources.items()}))

    def get(self, type_url: str) -> Resources:
        """This type's resources; a type the snapshot does not hold is empty, not an error."""
        found = self.by_type.get(type_url)
        return found if found is not None else Resources.of(type_url, ())

    @property
    def versions(self) -> dict[str, str]:
        return {type_url: res.version for type_url, res in self.by_type.items()}


def build_snapshot(plan: EnvoyPlan) -> Snapshot:
    """Resources for `plan`, checked; InvalidSnapshotError lists what Envoy would reject."""
    resources = resources_of(plan)
    add_picker(plan, resources)
    problems = snapshot_violations(resources)
    if problems:
        raise InvalidSnapshotError(problems)
    return Snapshot.of(resources)
