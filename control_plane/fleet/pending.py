"""A node's registration waiting for the registry's next write (registrations are group-committed:
those that arrive while one is being written share the next transaction)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from control_plane.audit import Actor
from control_plane.model import Node, NodeIdentity


@dataclass(slots=True)
class PendingRegistration:
    actor: Actor
    identity: NodeIdentity
    done: asyncio.Future[Node]


def settle(future: asyncio.Future[Node], like: asyncio.Future[Node]) -> None:
    """Give `future` the outcome of `like` (a done callback)."""
    if future.done():
        return
    if like.cancelled():
        future.cancel()
    elif (error := like.exception()) is not None:
        future.set_exception(error)
    else:
        future.set_result(like.result())
