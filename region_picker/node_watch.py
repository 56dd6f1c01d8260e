"""Follows the region's nodes at the control plane: a blocking query on
`/v1/regions/{region}/nodes` (wire/region_nodes.py), as gateways follow the summaries."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pydantic

from region_picker.node_book import NodeBook
from region_picker.routed_prefixes import RoutedPrefixes
from wire.region_nodes import RegionNodes

logger = logging.getLogger(__name__)

WAIT = "30s"
RETRY_S = 1.0


class NodeWatch:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        control_plane: str,
        region: str,
        token: str,
        book: NodeBook,
        routed: RoutedPrefixes,
    ) -> None:
        self._session = session
        self._url = f"{control_plane.rstrip('/')}/v1/regions/{region}/nodes"
        self._headers = {"Authorization": f"Bearer {token}"}
        self._book = book
        self._routed = routed
        self.has_nodes = asyncio.Event()  # set once a document has come

    async def poll(self) -> None:
        """One query: wait for a change past what the book holds, and adopt it."""
        params = {"index": str(self._book.index), "wait": WAIT}
        async with self._session.get(self._url, params=params, headers=self._headers) as reply:
            reply.raise_for_status()
            document = RegionNodes.model_validate_json(await reply.read())
        for node_id in self._book.adopt(document):
            self._routed.forget(node_id)
        self.has_nodes.set()

    async def run(self) -> None:
        """Poll until cancelled; a failed query is retried after RETRY_S (the picker keeps
        choosing among the nodes it knows)."""
        while True:
            try:
                await self.poll()
            except (aiohttp.ClientError, TimeoutError, pydantic.ValidationError) as exc:
                logger.warning("region nodes from %s: %s; retrying", self._url, exc)
                await asyncio.sleep(RETRY_S)
