"""A model catalog of a chosen size in the region summaries a gateway watches, for benchmarks.

    python -m bench.catalog_injector --port P --control-plane URL --models N --aliases-per-model M

Stands between the gateway and the control plane: every call passes through, and each region
summaries document gets `catalog` set to N models (`bench`, the model the benchmark's node
serves, then `bench-m1` ... with no nodes, each falling back to `bench`) and M aliases per model.
Only the gateway's watch goes through it, never a completion, so it costs the measured path
nothing; the catalog is whatever size the gateway must resolve against.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from wire.model_catalog import CatalogAlias, CatalogModel, ModelCatalog

SUMMARY_PATH = "/v1/regions/summary"
SERVED_MODEL = "bench"


def bench_catalog(num_models: int, aliases_per_model: int) -> ModelCatalog:
    names = [SERVED_MODEL] + [f"{SERVED_MODEL}-m{i}" for i in range(1, num_models)]
    models = [CatalogModel(name=SERVED_MODEL)] + [
        CatalogModel(name=name, fallbacks=(SERVED_MODEL,)) for name in names[1:]
    ]
    aliases = [
        CatalogAlias(name=f"{name}-a{j}", target=name)
        for name in names
        for j in range(aliases_per_model)
    ]
    return ModelCatalog(models=tuple(models), aliases=tuple(aliases))


def injector_app(control_plane_url: str, catalog: ModelCatalog) -> web.Application:
    catalog_fields = json.loads(catalog.model_dump_json())
    sessions: list[aiohttp.ClientSession] = []

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        sessions.append(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)))
        yield
        await sessions[0].close()

    async def forward(request: web.Request) -> web.Response:
        headers = {
            name: value
            for name, value in request.headers.items()
            if name.lower() not in ("host", "content-length")
        }
        async with sessions[0].request(
            request.method,
            control_plane_url + request.path_qs,
            data=await request.read(),
            headers=headers,
        ) as upstream:
            body = await upstream.read()
            if request.path == SUMMARY_PATH and upstream.status == 200:
                document = json.loads(body)
                document["catalog"] = catalog_fields
                body = json.dumps(document).encode()
            passed = {
                name: value
                for name, value in upstream.headers.items()
                if name.lower() not in ("content-length", "content-encoding", "transfer-encoding")
            }
            return web.Response(body=body, status=upstream.status, headers=passed)

    app = web.Application()
    app.cleanup_ctx.append(lifespan)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.catalog_injector")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-plane", required=True)
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument("--aliases-per-model", type=int, default=0)
    args = parser.parse_args()
    catalog = bench_catalog(args.models, args.aliases_per_model)
    app = injector_app(args.control_plane.rstrip("/"), catalog)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
