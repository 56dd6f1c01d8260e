"""`meridian anycast` and `meridian resolve`: the running stack's global front end, as an operator
and a client see it.

    meridian anycast                      which PoPs announce, and where each client city lands
    meridian anycast withdraw|announce P  take PoP P out of (or back into) the Anycast routes
    meridian resolve --from CITY [--short] the DNS answer a client in CITY gets (ECS, dnspython)
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Final

import dns.edns
import dns.exception
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import httpx

from stack.errors import StackError
from stack.state import StackState, StateDir
from stack.supervisor import Say
from wire.geo import CITIES, client_subnet_of

TIMEOUT_S: Final = 5.0
DNS_TRY_S: Final = 2.0  # per replica: on loopback an answer comes in milliseconds


def _running(state_root: Path) -> StackState:
    state = StateDir(state_root).read()
    if state is None:
        raise StackError(f"no stack is running (nothing recorded in {state_root}): `meridian up`")
    return state


def _anycast_url(state: StackState) -> str:
    if not state.anycast_url:
        raise StackError("this stack has no Anycast front (no `clients:` in its config)")
    return state.anycast_url


def _call(method: str, url: str) -> dict[str, Any]:
    try:
        response = httpx.request(method, url, timeout=TIMEOUT_S, trust_env=False)
    except httpx.HTTPError as exc:
        raise StackError(f"the Anycast front at {url} is not reachable ({exc})") from exc
    body: dict[str, Any] = response.json()
    if response.status_code != 200:
        raise StackError(
            str(body.get("error", f"the Anycast front answered {response.status_code}"))
        )
    return body


def anycast(state_root: Path, action: str | None, pop: str | None, say: Say) -> int:
    base = _anycast_url(_running(state_root)) + "/v1/anycast"
    if action is None:
        body = _call("GET", base)
    else:
        assert pop is not None
        body = _call("POST", f"{base}/{pop}/{action}")
        say(f"{pop}: {'withdrawn' if action == 'withdraw' else 'announced'}")
    for line in anycast_lines(body):
        say(line)
    return 0


def anycast_lines(body: dict[str, Any]) -> list[str]:
    lines = [f"Anycast {body['prefix']}:"]
    for name, pop in body["pops"].items():
        if pop["announced"]:
            how = "announced"
        elif pop["withdrawn_by_operator"]:
            how = "WITHDRAWN (operator)"
        else:
            how = "WITHDRAWN (health check failed)"
        lines.append(f"  PoP {name:<14}{pop['address']:<18}{how}")
    for city, client in body["clients"].items():
        where = f"→ {client['pop']} ({client['rtt_ms']} ms)" if client["pop"] else "→ nowhere"
        lines.append(f"  client {city:<11}{client['address']:<18}{where}")
    return lines


def _ask_replicas(query: dns.message.Message, ports: list[int]) -> dns.message.Message:
    """The first answer from the control-plane replicas' DNS ports, tried in turn (each answers
    the same; one that is down costs DNS_TRY_S)."""
    errors: list[str] = []
    for port in ports:
        try:
            return dns.query.udp(query, "127.0.0.1", timeout=DNS_TRY_S, port=port)
        except (dns.exception.DNSException, OSError) as exc:
            errors.append(f"udp 127.0.0.1:{port}: {exc or type(exc).__name__}")
    raise StackError(f"no answer from the DNS ({'; '.join(errors)})")


def resolve(state_root: Path, city: str, is_short: bool, say: Say) -> int:
    """Ask the stack's DNS for its API name as a client in `city` would (ECS: the city's subnet)."""
    if city not in CITIES:
        raise StackError(f"unknown city {city!r}; known: {', '.join(CITIES)}")
    state = _running(state_root)
    if not state.dns_name or not state.dns_port:
        raise StackError("this stack records no DNS name or port (started by an older meridian)")
    subnet = ipaddress.ip_network(client_subnet_of(city))
    option = dns.edns.ECSOption(str(subnet.network_address), subnet.prefixlen)
    query = dns.message.make_query(state.dns_name, "A", use_edns=0, options=[option])
    reply = _ask_replicas(query, state.dns_ports or [state.dns_port])
    records = [
        (rrset.ttl, str(rr))
        for rrset in reply.answer
        for rr in rrset
        if rrset.rdtype == dns.rdatatype.A
    ]
    if not records:
        raise StackError(
            f"{state.dns_name}: no address for {city} ({dns.rcode.to_text(reply.rcode())})"
        )
    ttl, address = records[0]
    if is_short:
        say(address)
        return 0
    by_address = {url.split("//", 1)[1].rsplit(":", 1)[0]: name for name, url in state.pops.items()}
    pop = by_address.get(address, "?")
    say(f"{city} ({subnet}) → {state.dns_name} A {address} (PoP {pop}), TTL {ttl} s")
    return 0
