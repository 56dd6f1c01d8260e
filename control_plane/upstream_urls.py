"""Which URLs may be registered as a region's ingress or a node's address: gateways send their
serving token and tenants' cache salts to the first, Envoy forwards requests to the second.

Every such URL must pass the rule of `wire/upstream_url.py` (`http(s)://HOST[:PORT]` only, no
link-local, unspecified, multicast or reserved address); that is checked where the URL enters
(`UpstreamUrl` in the admin API's bodies: 422). On top, an operator may list what hosts are
allowed at all (`allowed_upstreams`, e.g. `10.0.0.0/8,ingress.example.com`): IP networks, which
an IP host must be inside, and DNS names, which a name host must equal or end in (`.` + name).
An IP host never matches a name, nor a name a network (it could resolve anywhere). With the list
set, a URL outside it is 422 `url_not_allowed`, whether an operator gives it (regions, node
credentials, node moves) or a node's first heartbeat binds it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator

from control_plane.errors import ControlPlaneError
from wire.heartbeat import HttpUrlStr
from wire.upstream_url import host_of, ip_of, is_dns_name, url_problem

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


URL_NOT_ALLOWED = "url_not_allowed"


class UrlNotAllowedError(ControlPlaneError):
    status_code = 422


def _checked(url: str) -> str:
    problem = url_problem(url)
    if problem is not None:
        raise ValueError(problem)
    return url


# A URL an operator registers (a region's ingress, a node's address): the rule, at the edge.
UpstreamUrl = Annotated[HttpUrlStr, AfterValidator(_checked)]


@dataclass(frozen=True, slots=True)
class UpstreamAllowlist:
    """The operator's list; empty allows every URL that passes the rule."""

    networks: tuple[IpNetwork, ...] = ()
    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> UpstreamAllowlist:
        """Networks (`10.0.0.0/8`, `fd00::/8`, a bare address) and DNS names; ValueError names
        the first entry that is neither."""
        networks: list[IpNetwork] = []
        names: list[str] = []
        for entry in entries:
            text = entry.strip().lower()
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            if not is_dns_name(text):
                raise ValueError(f"{entry!r} is neither an IP network nor a DNS name")
            names.append(text.rstrip("."))
        return cls(tuple(networks), tuple(names))

    @property
    def is_open(self) -> bool:
        return not self.networks and not self.names

    def allows_host(self, host: str) -> bool:
        if self.is_open:
            return True
        address = ip_of(host)
        if address is not None:
            return any(address in network for network in self.networks)
        name = host.rstrip(".")
        return any(name == allowed or name.endswith("." + allowed) for allowed in self.names)

    def problem(self, url: str) -> str | None:
        """Why `url` may not be registered (the rule, then the list), or None if it may."""
        problem = url_problem(url)
        if problem is None and not self.allows_host(host_of(url)):
            problem = f"its host is not in allowed_upstreams ({self.describe()})"
        return problem

    def check(self, url: str | None, what: str) -> None:
        """Raise UrlNotAllowedError (422) unless `url` (None: none given) may be registered."""
        problem = None if url is None else self.problem(url)
        if problem is not None:
            raise UrlNotAllowedError(f"{what} {url}: {problem}", URL_NOT_ALLOWED)

    def describe(self) -> str:
        return ", ".join([*(str(n) for n in self.networks), *self.names])
