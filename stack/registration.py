"""What `meridian up` writes into the control plane through its admin API, once the control
plane is ready: the regions (with their ingress URLs), each node agent's and each region Envoy's
own credential, and the stack's API key."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.admin_cli import (
    AdminClient,
    AdminCliError,
    RegionSpec,
    mint_node_credential,
    mint_xds_credential,
    put_region,
)
from stack.config import ApiKeyConfig
from stack.errors import StackError
from stack.layout import StackLayout
from stack.supervisor import Say


@dataclass(slots=True)
class Credentials:
    """The tokens minted at registration."""

    node_tokens: dict[str, str] = field(default_factory=dict)  # each node agent's, by node id
    xds_tokens: dict[str, str] = field(default_factory=dict)  # each region Envoy's, by region


def register_regions(client: AdminClient, layout: StackLayout, say: Say) -> Credentials:
    """Every region of the layout, and a credential for each of its node agents and its Envoy."""
    credentials = Credentials()
    try:
        for region in layout.regions:
            spec = RegionSpec(region.name, region.lat, region.lon, region.ingress_url, 1.0)
            put_region(client, spec)
            rtts = ", ".join(f"{path.pop} {path.rtt_ms:g}" for path in region.paths)
            say(
                f"  region {region.name} registered ({region.lat:g}, {region.lon:g}; "
                f"ingress {region.ingress_url}; RTT ms from {rtts})"
            )
            for node in region.nodes:
                credentials.node_tokens[node.node_id] = mint_node_credential(
                    client, node.node_id, region.name, node.url
                )
            if region.envoy_port is not None:
                name = f"envoy-{region.name}"
                credentials.xds_tokens[region.name] = mint_xds_credential(client, name, region.name)
    except AdminCliError as exc:
        raise StackError(f"registering regions: {exc}") from exc
    return credentials


def create_api_key(client: AdminClient, key: ApiKeyConfig) -> str:
    """A fresh API key with the configured limits; its secret."""
    body = {"name": key.name, "rpm": key.rpm, "tpm": key.tpm}
    try:
        response = client.call("POST", "/v1/keys", body)
    except AdminCliError as exc:
        raise StackError(f"creating an API key: {exc}") from exc
    if response.status_code != 201:
        raise StackError(f"creating an API key: {response.status_code} {response.text[:200]}")
    secret: str = response.json()["secret"]
    return secret
