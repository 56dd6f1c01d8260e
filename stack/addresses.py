"""The address every part of the stack but the PoPs' gateways listens on, and URLs on it."""

from __future__ import annotations

HOST = "127.0.0.1"


def url_of(port: int, scheme: str = "http") -> str:
    return f"{scheme}://{HOST}:{port}"
