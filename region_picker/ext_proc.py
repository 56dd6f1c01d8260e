"""The Envoy `ext_proc` gRPC service: per request, its headers and buffered body in, a header
naming the chosen node out (DESTINATION_HEADER, with the route cache cleared so that Envoy
routes on it).

Envoy opens one stream per HTTP request and sends the request's headers, then its body (whole,
or as much as its buffer holds: a body cut short does not parse, and Envoy balances that
request itself), then the response's headers: until they come the request counts as pending
on the node named (it waits or prefills there). Any request this service does not answer in
time, or at all, goes on without it (`failure_mode_allow`). A request the picker sends back to
its gateway (wire/deflection.py) gets Envoy's immediate answer instead: 429 with
DEFLECTED_HEADER and an OpenAI error body, before any node sees it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2

from region_picker.metrics import PickerMetrics
from region_picker.picker import Deflection, Picker
from wire.deflection import DEFLECTED_HEADER
from wire.region_nodes import DESTINATION_HEADER

logger = logging.getLogger(__name__)

_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CONTINUE_RESPONSE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    """Lower-case names to values (Envoy sends the value as raw bytes)."""
    return {
        h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        for h in message.headers.headers
    }


def _header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def destination_response(address: str) -> pb.ProcessingResponse:
    mutation = pb.HeaderMutation(set_headers=[_header(DESTINATION_HEADER, address)])
    common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def deflection_response(deflection: Deflection) -> pb.ProcessingResponse:
    message = (
        f"sent back to the gateway: the region's best node is {deflection.wait_s:.3f} s from a "
        f"first token, the next-best region {deflection.alternative_s:.3f} s"
    )
    error = {"message": message, "type": "rate_limit_error", "param": None, "code": "deflected"}
    answer = pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=http_status_pb2.TooManyRequests),
        headers=pb.HeaderMutation(
            set_headers=[
                _header("content-type", "application/json"),
                _header(DEFLECTED_HEADER, "picker"),
            ]
        ),
        body=json.dumps({"error": error}).encode(),
        details="meridian_picker_deflected",
    )
    return pb.ProcessingResponse(immediate_response=answer)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, metrics: PickerMetrics) -> None:
        self._picker = picker
        self._metrics = metrics

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        headers: dict[str, str] = {}
        pending: str | None = None  # the node named, until its response starts
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    headers = headers_of(request.request_headers)
                    yield _CONTINUE_HEADERS
                elif kind == "request_body":
                    answer, pending = self._answer(headers, request.request_body.body)
                    yield answer
                elif kind == "response_headers":
                    if pending is not None:
                        self._picker.started(pending)
                        pending = None
                    yield _CONTINUE_RESPONSE
                # Nothing else is asked for (control_plane/xds/picker.py).
        finally:
            if pending is not None:  # the request ended (or Envoy gave up on us) unanswered
                self._picker.started(pending)

    def _answer(
        self, headers: dict[str, str], body: bytes
    ) -> tuple[pb.ProcessingResponse, str | None]:
        """The answer to a request's body, and the node it names (None: Envoy balances it)."""
        started = time.perf_counter()
        try:
            decision = self._picker.decide(headers, body)
        except Exception:
            logger.exception("ext_proc: the decision failed; Envoy balances this request")
            self._metrics.fallback("error")
            return _CONTINUE_BODY, None
        finally:
            self._metrics.decision_seconds.observe(time.perf_counter() - started)
        if decision is None:
            return _CONTINUE_BODY, None
        if isinstance(decision, Deflection):
            return deflection_response(decision), None
        chosen = decision.chosen.candidate
        return destination_response(chosen.address), chosen.node_id


async def serve(processor: ExternalProcessor, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server; returns it and the port it bound (0: any free one)."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound
