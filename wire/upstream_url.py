"""The URL of a service requests are sent to with our credentials (a region's ingress, a node
agent): what the control plane accepts from operators, and what a gateway sends its serving token
and a tenant's cache salt to.

Such a URL is `http(s)://HOST[:PORT]` with at most a lone `/` after it: no user info, no path, no
query, no fragment. Whoever sends a request joins the request's own path to it (`join_path`), so
a path or a query given here could only redirect or swallow that path
(`http://x/internal?steal=` + `/v1/chat/completions`). HOST is an IP address, or a DNS name whose
last label starts with a letter (so that `2852039166` or `0x7f.1`, which resolvers read as
addresses, are not names). Addresses that are never one of our services are refused whatever an
operator allows: link-local ones (169.254.0.0/16 and fe80::/10, where cloud metadata services
live), unspecified, multicast, reserved and broadcast addresses, also inside IPv4-mapped IPv6.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final
from urllib.parse import SplitResult, urlsplit

SCHEMES: Final = frozenset({"http", "https"})
MAX_URL_LEN: Final = 2048
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_DNS_NAME = re.compile(rf"^(?:{_LABEL}\.)*[a-z](?:[a-z0-9-]{{0,61}}[a-z0-9])?\.?$")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def is_dns_name(host: str) -> bool:
    """A lower-case DNS name whose last label starts with a letter (an optional final dot)."""
    return _DNS_NAME.match(host) is not None


def ip_of(host: str) -> IpAddress | None:
    """`host` as an IP address (IPv4-mapped IPv6 as its IPv4), or None for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _address_problem(address: IpAddress) -> str | None:
    if address.is_loopback:
        return None  # IPv6's ::1 sits in a reserved range, and is this machine
    for is_bad, what in (
        (address.is_link_local, "link-local (where cloud metadata services live)"),
        (address.is_unspecified, "the unspecified address"),
        (address.is_multicast, "multicast"),
        (address.is_reserved, "reserved"),
        (address == ipaddress.IPv4Address("255.255.255.255"), "the broadcast address"),
    ):
        if is_bad:
            return f"{address} is {what}"
    return None


def _parts_problem(url: str) -> tuple[SplitResult | None, str | None]:
    if len(url) > MAX_URL_LEN or not url.isascii() or not url.isprintable() or " " in url:
        return None, "must be printable ASCII without spaces, at most 2048 characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        return None, f"is not a URL ({exc})"
    if parts.scheme not in SCHEMES:
        return None, "must be http:// or https://"
    if "@" in parts.netloc:
        return None, "must not hold user info (user:password@)"
    if parts.path not in ("", "/") or "?" in url or "#" in url:
        return None, "must be scheme://host[:port] only: no path, query or fragment"
    if not parts.hostname:
        return None, "must name a host"
    return parts, None


def url_problem(url: str) -> str | None:
    """Why `url` may not be an upstream's URL, or None if it may."""
    parts, problem = _parts_problem(url)
    if parts is None:
        return problem
    host = parts.hostname
    assert host is not None
    address = ip_of(host)
    if address is None:
        return None if is_dns_name(host) else f"host {host!r} is neither an IP nor a DNS name"
    return _address_problem(address)


def host_of(url: str) -> str:
    """The host of a URL `url_problem` accepted, lower-case, without brackets."""
    host = urlsplit(url).hostname
    assert host is not None
    return host


def join_path(base: str, path: str) -> str:
    """`path` (with its query, if any) on the scheme, host and port of `base`, whatever else
    `base` carries: never their concatenation."""
    parts = urlsplit(base)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    target = urlsplit(path)
    return SplitResult(parts.scheme, netloc, target.path or "/", target.query, "").geturl()
