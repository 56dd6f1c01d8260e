"""Regions: operators register, edit and remove them; gateways watch their summaries."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from fastapi.responses import JSONResponse

from control_plane.api.auth import AdminAuth, GatewayAuth
from control_plane.api.blocking import INDEX_HEADER_DOC, Index, Wait, indexed_json, wait_past
from control_plane.errors import ERROR_RESPONSES
from control_plane.model import Region
from control_plane.safe_text import SafePathName
from control_plane.schemas import RegionCreate, RegionList, RegionPatch, RegionView, view_from
from control_plane.services import ServicesDep
from wire.region_summary import RegionSummaryIndex

router = APIRouter(prefix="/v1/regions", tags=["regions"], responses=ERROR_RESPONSES)


def view_of(region: Region) -> RegionView:
    return view_from(RegionView, region)


@router.get(
    "/summary",
    response_model=RegionSummaryIndex,
    responses=INDEX_HEADER_DOC,
)
async def watch_summaries(
    actor: GatewayAuth, services: ServicesDep, index: Index = 0, wait: Wait = "0s"
) -> Response:
    """Blocking query: answers at once if the index differs from `index`, else waits for a
    change or for `wait` to pass (then with the same index)."""
    publisher = services.summaries
    await wait_past(publisher.feed, index, wait, services.settings.max_wait_s)
    return indexed_json(publisher.body, publisher.current.index)


@router.post("", status_code=status.HTTP_201_CREATED)
async def create_region(actor: AdminAuth, services: ServicesDep, body: RegionCreate) -> RegionView:
    services.settings.upstream_allowlist.check(body.ingress_url, "ingress_url")
    return view_of(await services.registry.create_region(actor, body))


@router.get("")
async def list_regions(actor: AdminAuth, services: ServicesDep) -> RegionList:
    regions = sorted(services.fleet.regions.values(), key=lambda r: r.name)
    return RegionList(regions=[view_of(region) for region in regions])


@router.get("/{name}")
async def get_region(actor: AdminAuth, services: ServicesDep, name: SafePathName) -> RegionView:
    return view_of(services.registry.get_region(name))


@router.patch("/{name}")
async def update_region(
    actor: AdminAuth, services: ServicesDep, name: SafePathName, patch: RegionPatch
) -> RegionView:
    services.settings.upstream_allowlist.check(patch.ingress_url, "ingress_url")
    return view_of(await services.registry.update_region(actor, name, patch))


@router.delete(
    "/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={
        202: {"model": RegionView, "description": "Its nodes drain first; then it is deleted"}
    },
)
async def delete_region(actor: AdminAuth, services: ServicesDep, name: SafePathName) -> Response:
    """Deregister a region (`terraform destroy`). With no nodes known in it: deleted now (204).
    Otherwise 202: it is set draining, each node runs the drain sequence, and once all have been
    told to exit the region and its nodes are forgotten (then GET answers 404). Idempotent."""
    region = await services.registry.delete_region(actor, name)
    if region is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return JSONResponse(view_of(region).model_dump(), status_code=status.HTTP_202_ACCEPTED)
