"""What `meridian up` writes into the control plane through its admin API, once the control plane
is ready: the regions (with their ingress URLs and pickers), each node agent's and each region
Envoy's own credential, the model catalog (models, fallbacks, aliases), and the stack's API key."""

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
from wire.model_catalog import CatalogAlias, ModelCatalog


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
            picker = region.picker.address if region.picker is not None else None
            spec = RegionSpec(region.name, region.lat, region.lon, region.ingress_url, 1.0, picker)
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


def register_models(client: AdminClient, catalog: ModelCatalog, say: Say) -> None:
    """The config's catalog into the control plane's (a fresh one, empty): the models, then each
    alias after the alias it points to, then the fallbacks, which may name either."""
    calls: list[tuple[str, str, dict[str, object]]] = [
        ("POST", "/v1/models", {"name": model.name, "owned_by": model.owned_by})
        for model in catalog.models
    ]
    calls += [
        ("POST", "/v1/models", {"name": alias.name, "target": alias.target})
        for alias in _targets_first(catalog.aliases)
    ]
    calls += [
        ("PATCH", f"/v1/models/{model.name}", {"fallbacks": list(model.fallbacks)})
        for model in catalog.models
        if model.fallbacks
    ]
    for method, path, body in calls:
        try:
            response = client.call(method, path, body)
        except AdminCliError as exc:
            raise StackError(f"registering the models: {exc}") from exc
        if response.status_code not in (200, 201):
            raise StackError(
                f"registering the models: {method} {path}: {response.status_code} "
                f"{response.text[:200]}"
            )
    aliases = "".join(f", alias {alias.name} → {alias.target}" for alias in catalog.aliases)
    say(f"  models registered: {', '.join(model.name for model in catalog.models)}{aliases}")


def _targets_first(aliases: tuple[CatalogAlias, ...]) -> list[CatalogAlias]:
    targets = {alias.name: alias.target for alias in aliases}

    def hops(name: str) -> int:  # the catalog is checked: every chain ends at a model
        return 1 + hops(targets[name]) if name in targets else 0

    return sorted(aliases, key=lambda alias: hops(alias.name))


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
