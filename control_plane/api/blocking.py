"""Query parameters and response shape shared by the blocking (watch) routes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Response

from control_plane.changes import WAIT_PATTERN, ChangeFeed, parse_wait_s

INDEX_HEADER = "X-Meridian-Index"

Index = Annotated[int, Query(ge=0, le=2**62, description="last index seen; 0 = do not block")]
Wait = Annotated[
    str, Query(pattern=WAIT_PATTERN, description='longest wait, e.g. "30s", "500ms", "1m"')
]
# OpenAPI: the header every watch response carries.
INDEX_HEADER_DOC: dict[int | str, dict[str, Any]] = {
    200: {"headers": {INDEX_HEADER: {"schema": {"type": "integer"}}}}
}


async def wait_past(feed: ChangeFeed, index: int, wait: str, max_wait_s: float) -> None:
    """Hold a watch until `feed` moves past `index`, or for `wait` (at most `max_wait_s`)."""
    await feed.wait_past(index, parse_wait_s(wait, max_wait_s))


def indexed_json(body: bytes | str, index: int) -> Response:
    return Response(content=body, media_type="application/json", headers={INDEX_HEADER: str(index)})
