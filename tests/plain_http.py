"""httpx clients of the suite's plain-HTTP servers on loopback, sharing one SSL context: httpx
makes a context for every client, loading the CA bundle (~28 ms of CPU: 10 s over `make
test-fast`), though a client of http://127.0.0.1 never uses it."""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def _context() -> ssl.SSLContext:
    return ssl.create_default_context()


def client(**kwargs: Any) -> httpx.Client:
    return httpx.Client(verify=_context(), **kwargs)


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=_context(), **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    with client() as http:
        return http.get(url, **kwargs)
