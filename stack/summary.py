"""What `meridian up` prints once the stack is ready: what runs, where (regions, PoPs, client
cities, tiers, the models and the regions serving each), the key, and examples to copy and paste
(a curl per client city through the Anycast front, one per model and alias, one through DNS, and
the `openai` client verifying the stack's CA)."""

from __future__ import annotations

import sys
from pathlib import Path

from gateway.anycast import Anycast, pops_at
from stack.layout import HOST, StackLayout
from wire.geo import LOCATIONS, locate
from wire.model_catalog import CatalogIndex, ModelCatalog


def count(num: int, noun: str) -> str:
    return f"{num} {noun}" + ("" if num == 1 else "s")


def limits_mode(layout: StackLayout) -> str:
    """Which per-key limits are live, in words (also in `meridian status`)."""
    across = "across PoPs by the control plane's shares"
    ports = [str(pop.redis_port) for pop in layout.pops if pop.redis_port is not None]
    if ports:
        return (
            f"{across}; each PoP's buckets in a redis-server of its own (ports {', '.join(ports)})"
        )
    return f"{across}; each PoP's buckets in its gateway process"


def catchments(layout: StackLayout) -> dict[str, tuple[str, float]]:
    """Client city → the PoP the Anycast front sends it to with everything announced, and the
    RTT between them."""
    if not layout.pops:
        return {}
    table = Anycast(pops_at([pop.name for pop in layout.pops], LOCATIONS))
    routes = {client.city: table.reach(locate(client.city)) for client in layout.clients}
    return {city: (route.pop, route.rtt_ms) for city, route in routes.items()}


def _front_lines(layout: StackLayout) -> list[str]:
    lines = []
    for i, pop in enumerate(layout.pops):
        tier = f"tiers edge ({pop.edge_url}) + region" if pop.edge_url else "tier region"
        head = "  PoPs      " if i == 0 else "            "
        lines.append(f"{head}{pop.name:<14}{pop.url}/v1   ({tier})")
    reached = catchments(layout)
    for i, client in enumerate(layout.clients):
        nearest, rtt = reached[client.city]
        head = "  Cities    " if i == 0 else "            "
        lines.append(
            f"{head}{client.city:<14}{client.url}/v1   (Anycast → {nearest}, {rtt:.0f} ms)"
        )
        if (direct := client.direct) is not None:
            lines.append(
                f"            {'':<14}{direct.url}/v1   (public, straight to {direct.region}, "
                f"{direct.rtt_ms:.0f} ms: no PoP, no key)"
            )
    ports = [replica.dns_port for replica in layout.control_planes]
    lines.append(
        f"  DNS       {layout.dns_name} on {dns_endpoints(ports)}   "
        "(`meridian resolve --from CITY`)"
    )
    return lines


def _model_lines(layout: StackLayout, catalog: ModelCatalog, default_model: str) -> list[str]:
    """Each model with the regions serving it and its fallbacks, each alias, and `auto`."""
    index = CatalogIndex.of(catalog)
    width = max(len(name) for name in [*index.model_of, "auto"]) + 2
    rows = []
    for model in catalog.models:
        regions = [region.name for region in layout.regions if model.name in region.models]
        where = ", ".join(regions) or "no region"
        fallbacks = index.fallbacks_of[model.name]
        then = f" (then {', '.join(fallbacks)})" if fallbacks else ""
        rows.append(f"{model.name:<{width}}{where}{then}")
    rows += [f"{alias.name:<{width}}→ {alias.target}" for alias in catalog.aliases]
    has_edge = any(pop.edge_port is not None for pop in layout.pops)
    edge = "light requests at an edge node where there is one, else " if has_edge else ""
    rows.append(f"{'auto':<{width}}{edge}→ {default_model}")
    return [("  Models    " if i == 0 else "            ") + row for i, row in enumerate(rows)]


def dns_endpoints(ports: list[int]) -> str:
    """Where the API name is answered: every control-plane replica serves DNS, and a client
    (or `meridian resolve`) may ask any of them."""
    where = ", ".join(f"{HOST}:{port}" for port in ports)
    return f"udp {where}" + (" (one per control-plane replica)" if len(ports) > 1 else "")


def _curl(url: str, ca_cert: str, api_key: str, model: str, extra: str = "") -> str:
    message = '[{"role": "user", "content": "Hello!"}]'
    body = f'{{"model": "{model}", "max_tokens": 16, "messages": {message}}}'
    return f"""curl -si --cacert {ca_cert}{extra} {url}/v1/chat/completions \\
  -H "Authorization: Bearer {api_key}" -H "Content-Type: application/json" \\
  -d '{body}' | grep -i -e '^x-meridian' -e content"""


def commands_here() -> tuple[str, str]:
    """`meridian` and `python` as a pasted example must run them: this install's own (after
    `make up` the virtual environment is not on PATH, and a bare `python` lacks `openai`)."""
    meridian = Path(sys.executable).with_name("meridian")
    return (str(meridian) if meridian.exists() else "meridian"), sys.executable


def render_summary(
    layout: StackLayout,
    catalog: ModelCatalog,
    model: str,
    api_key: str,
    ca_cert: str,
    state_dir: Path,
) -> str:
    """What `up` prints once everything is ready: what runs, where, the key, and copy-paste
    examples (starting mid-sentence: "Meridian is up: " goes before it). `model`: the default
    (what `auto` and the examples ask for)."""
    base = layout.gateway_url + "/v1"
    num_envoys = sum(region.envoy_port is not None for region in layout.regions)
    names = ", ".join(region.name for region in layout.regions)
    pops = ", ".join(pop.name for pop in layout.pops)
    num_edges = sum(pop.edge_port is not None for pop in layout.pops)
    edges = f", {count(num_edges, 'edge node')}" if num_edges else ""
    cities = "".join(
        f"\n# from {client.city}:\n{_curl(client.url, ca_cert, api_key, 'auto')}\n"
        for client in layout.clients
    )
    first_city = layout.clients[0].city if layout.clients else "new-york"
    meridian, python = commands_here()
    resolved = f"$({meridian} resolve --from {first_city} --short)"
    by_dns = _curl(
        f"https://{layout.dns_name}:{layout.gateway_port}",
        ca_cert,
        api_key,
        model,
        f" \\\n  --resolve {layout.dns_name}:{layout.gateway_port}:{resolved}",
    )
    by_model = "\n".join(
        _curl(layout.gateway_url, ca_cert, api_key, name)
        for name in [*(m.name for m in catalog.models), *(a.name for a in catalog.aliases)]
    )
    front = "\n".join(_front_lines(layout))
    models = "\n".join(_model_lines(layout, catalog, model))
    return f"""{count(len(layout.regions), "region")} ({names}), \
{count(len(layout.nodes), "node agent")}, {count(num_envoys, "Envoy")}, \
{count(len(layout.pops), "PoP")} ({pops}){edges}, \
{len(layout.clients)} client {"city" if len(layout.clients) == 1 else "cities"}.

  Gateway   {base}   (PoP {layout.pops[0].name})
{front}
  Limits    {limits_mode(layout)}
{models}
  API key   {api_key}   (shown once; a new one on every `meridian up`)
  CA cert   {ca_cert}
  Admin     {layout.control_plane_urls}   (tokens in {state_dir / "tokens.env"})
  Logs      {state_dir / "logs"}/

Try it (the x-meridian-pop, -region and -tier headers say where each request went):
{cities}
# each model and alias (x-meridian-model names the model that answered, -region where):
{by_model}

# through DNS (the nearest healthy PoP for {first_city}'s subnet):
{by_dns}

curl --cacert {ca_cert} {base}/chat/completions \\
  -H "Authorization: Bearer {api_key}" -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

{python} - <<'EOF'
import ssl, httpx, openai
client = openai.OpenAI(
    base_url="{base}", api_key="{api_key}",
    http_client=httpx.Client(verify=ssl.create_default_context(cafile="{ca_cert}")))
for chunk in client.chat.completions.create(
        model="{model}", stream=True,
        messages=[{{"role": "user", "content": "What is the capital of France?"}}]):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
EOF

`{meridian} status` shows the fleet; `{meridian} anycast withdraw|announce POP` moves
clients; `{meridian} down` stops it."""
