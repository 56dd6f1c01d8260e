"""The routing policy: one document, stored in the meta table, replaced as a whole by operators."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pydantic import ValidationError

from control_plane import audit
from control_plane.audit import Actor
from control_plane.store.base import Connection, Store, StoreError, get_meta, set_meta
from wire.routing_policy import RoutingPolicy

POLICY_KEY = "routing_policy"


def load_policy(conn: Connection) -> RoutingPolicy:
    stored = get_meta(conn, POLICY_KEY)
    if stored is None:
        return RoutingPolicy()
    try:
        return RoutingPolicy.model_validate_json(stored)
    except ValidationError as exc:
        raise StoreError(f"stored routing policy is invalid: {exc}") from exc


class PolicyRegistry:
    def __init__(self, store: Store, policy: RoutingPolicy, on_change: Callable[[], None]) -> None:
        self._store = store
        self._policy = policy
        self._on_change = on_change
        self._lock = asyncio.Lock()  # memory follows the store's commit order

    @property
    def policy(self) -> RoutingPolicy:
        return self._policy

    async def follow(self) -> None:
        """Another replica replaced the policy: read it, unless a replacement made here is under
        way (it holds the lock from its write to memory: a read taken before its commit would
        undo it)."""
        async with self._lock:
            policy = await self._store.read(load_policy)
            if policy != self._policy:
                self._policy = policy
                self._on_change()

    async def replace(self, actor: Actor, policy: RoutingPolicy) -> RoutingPolicy:
        def change(conn: Connection) -> None:
            old = load_policy(conn)
            set_meta(conn, POLICY_KEY, policy.model_dump_json())
            detail = policy.model_dump() | {audit.OLD_KEY: old.model_dump()}
            audit.record(conn, actor, "routing.replace", "routing", detail)

        async with self._lock:
            await self._store.write(change, ("routing",))
            self._policy = policy
        self._on_change()
        return policy
