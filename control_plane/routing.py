"""The routing policy: one document, stored in the meta table, replaced as a whole by operators."""

from __future__ import annotations

from collections.abc import Callable

from control_plane import audit
from control_plane.audit import Actor
from control_plane.store.base import Connection, Store
from control_plane.store.meta_document import MetaDocument, load_document
from wire.routing_policy import RoutingPolicy

POLICY_KEY = "routing_policy"


def load_policy(conn: Connection) -> RoutingPolicy:
    return load_document(conn, POLICY_KEY, RoutingPolicy)


class PolicyRegistry:
    def __init__(self, store: Store, policy: RoutingPolicy, on_change: Callable[[], None]) -> None:
        self._document = MetaDocument(store, POLICY_KEY, policy, on_change)

    @property
    def policy(self) -> RoutingPolicy:
        return self._document.current

    async def follow(self) -> None:
        """Another replica replaced the policy: read it."""
        await self._document.follow()

    async def replace(self, actor: Actor, policy: RoutingPolicy) -> RoutingPolicy:
        def change(conn: Connection, old: RoutingPolicy) -> tuple[RoutingPolicy, RoutingPolicy]:
            detail = policy.model_dump() | {audit.OLD_KEY: old.model_dump()}
            audit.record(conn, actor, "routing.replace", "routing", detail)
            return policy, policy

        return await self._document.replace(change, ("routing",))
