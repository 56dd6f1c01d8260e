"""The answer to a refused credential (401, 403), recorded as it goes out
(`control_plane.refusals`): the one place every route's refusals pass, heartbeats included."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from control_plane.audit import Actor
from control_plane.errors import (
    AuthenticationError,
    ControlPlaneError,
    PermissionDeniedError,
    control_plane_error_response,
)
from control_plane.refusals import Refusal, printable
from control_plane.services import ControlPlane

ANONYMOUS = "anonymous"  # the actor of a 401: no valid credential was presented


def refusal_of(request: Request, exc: ControlPlaneError) -> Refusal:
    address = request.client.host if request.client else "unknown"
    client = f"{address}:{request.client.port}" if request.client else address
    agent = printable(request.headers.get("user-agent", ""))
    kind = exc.presented if isinstance(exc, PermissionDeniedError) else ANONYMOUS
    return Refusal(
        address=address,
        actor=Actor(kind=kind, client=f"{client} ({agent})" if agent else client),
        status=exc.status_code,
        code=exc.code,
        target=f"{request.method} {printable(request.url.path)}",
        message=exc.message,
    )


async def on_refused(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AuthenticationError | PermissionDeniedError)
    services = getattr(request.app.state, "services", None)
    if isinstance(services, ControlPlane):
        await services.refusals.record(refusal_of(request, exc))
    return control_plane_error_response(exc)


def install_refusal_handler(app: FastAPI) -> None:
    """More specific than the handler of every ControlPlaneError: these two come here."""
    app.add_exception_handler(AuthenticationError, on_refused)
    app.add_exception_handler(PermissionDeniedError, on_refused)
