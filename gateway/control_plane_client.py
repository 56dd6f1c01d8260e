"""The gateway's calls to the control plane (the watches and the usage reports): one bearer
token, the replicas' URLs in turn (wire/control_plane_urls.py; the caller rotates them when a
call fails), and any answer but 200 refused."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from wire.control_plane_urls import ControlPlaneUrls


class RejectedError(Exception):
    """The control plane answered with a status other than 200."""


# What a failed call raises: no answer, a refusal, or an answer that is not the document.
CALL_FAILURES = (aiohttp.ClientError, TimeoutError, ValidationError, RejectedError)


@dataclass(frozen=True, slots=True)
class ControlPlaneClient:
    session: aiohttp.ClientSession
    urls: ControlPlaneUrls
    token: str

    def url_of(self, path: str) -> str:
        """`path` at the replica called now."""
        return self.urls.current + path

    async def call(
        self,
        method: str,
        path: str,
        timeout_s: float,
        params: dict[str, str] | None = None,
        json_body: str | None = None,
    ) -> bytes:
        """The body of a 200 answer to `method path`; RejectedError for any other status."""
        headers = {"Authorization": f"Bearer {self.token}"}
        if json_body is not None:
            headers["Content-Type"] = "application/json"
        async with self.session.request(
            method,
            self.url_of(path),
            params=params,
            data=json_body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            body = await response.read()
            if response.status != 200:
                raise RejectedError(f"HTTP {response.status}: {body[:200]!r}")
        return body
