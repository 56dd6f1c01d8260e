"""The ext_proc stream as Envoy drives it: the headers let through at once, the buffered body's
answer names the node, which counts the request as pending until its response's headers (or the
stream's end); a request sent back gets Envoy's answer."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Iterable

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from engine.loader import Checkpoint
from region_picker.cache_index import CacheIndex, ExactOrGuessed
from region_picker.ext_proc import ExternalProcessor
from region_picker.metrics import PickerMetrics
from region_picker.node_book import NodeBook
from region_picker.picker import Picker
from region_picker.prompt_hashes import PromptHasher
from region_picker.routed_prefixes import RoutedPrefixes
from wire.cache_salt import CACHE_SALT_HEADER
from wire.deflection import ALTERNATIVE_HEADER, DEFLECTED_HEADER
from wire.region_nodes import DESTINATION_HEADER, NodeLoad, RegionNodes

MODEL = "smollm2-135m-instruct"
NODE = NodeLoad(
    node_id="node-a",
    url="http://127.0.0.1:9001",
    model=MODEL,
    block_size=16,
    kv_blocks_total=1000,
    kv_blocks_free=1000,
    prefill_tokens_per_s=1000.0,
    step_s=0.02,
)


@pytest.fixture
def book() -> NodeBook:
    book = NodeBook()
    book.adopt(RegionNodes(index=1, region="us-east", nodes=(NODE,)))
    return book


@pytest.fixture
def processor(smollm2_checkpoint: Checkpoint, book: NodeBook) -> ExternalProcessor:
    hasher = PromptHasher(smollm2_checkpoint.tokenizer, 16)
    routed, metrics = RoutedPrefixes(), PickerMetrics()
    view = ExactOrGuessed(CacheIndex(), routed)
    picker = Picker(book, {MODEL: hasher}, view, routed, metrics, random.Random(0))
    return ExternalProcessor(picker, metrics)


def headers(**values: str) -> pb.ProcessingRequest:
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map))


def body(payload: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=payload, end_of_stream=True))


RESPONSE_HEADERS = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
CHAT = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Which node holds my prompt?"}]}
).encode()


async def feed(requests: Iterable[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingRequest]:
    for request in requests:
        yield request


async def collect(
    processor: ExternalProcessor, requests: Iterable[pb.ProcessingRequest]
) -> list[pb.ProcessingResponse]:
    stream = processor.Process(feed(requests), None)
    return [answer async for answer in stream]


def destination(answer: pb.ProcessingResponse) -> str | None:
    common = answer.request_body.response
    named = [
        h.header.raw_value.decode()
        for h in common.header_mutation.set_headers
        if h.header.key == DESTINATION_HEADER
    ]
    return named[0] if named else None


@pytest.mark.asyncio
async def test_the_bodys_answer_names_the_node_which_counts_it_pending_until_its_response(
    processor: ExternalProcessor, book: NodeBook
) -> None:
    requests = [headers(**{CACHE_SALT_HEADER: "tenant-1"}), body(CHAT), RESPONSE_HEADERS]
    stream = processor.Process(feed(requests), None)
    let_through = await anext(stream)
    assert let_through.WhichOneof("response") == "request_headers"
    assert not let_through.request_headers.HasField("response")
    named = await anext(stream)
    assert destination(named) == "127.0.0.1:9001"
    assert named.request_body.response.clear_route_cache
    assert [c.num_pending for c in book.candidates(MODEL)] == [1]
    assert (await anext(stream)).WhichOneof("response") == "response_headers"
    assert [c.num_pending for c in book.candidates(MODEL)] == [0]
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


@pytest.mark.asyncio
async def test_a_request_ended_before_its_response_is_pending_no_more(
    processor: ExternalProcessor, book: NodeBook
) -> None:
    """Envoy gave up on the stream (the client left, the picker was too slow): the node named
    must not count the request as pending for ever."""
    *_, answer = await collect(processor, [headers(), body(CHAT)])
    assert destination(answer) == "127.0.0.1:9001"
    assert [c.num_pending for c in book.candidates(MODEL)] == [0]


@pytest.mark.asyncio
async def test_a_body_that_does_not_parse_names_no_node(processor: ExternalProcessor) -> None:
    """As Envoy sends a body past its buffer: cut short."""
    *_, answer = await collect(processor, [headers(), body(CHAT[: len(CHAT) // 2])])
    assert answer.WhichOneof("response") == "request_body" and destination(answer) is None
    assert processor._metrics.fallbacks.labels("unreadable_body")._value.get() == 1


@pytest.mark.asyncio
async def test_a_request_sent_back_gets_envoys_answer(processor: ExternalProcessor) -> None:
    *_, answer = await collect(processor, [headers(**{ALTERNATIVE_HEADER: "0.001"}), body(CHAT)])
    immediate = answer.immediate_response
    assert immediate.status.code == 429
    assert DEFLECTED_HEADER in {h.header.key for h in immediate.headers.set_headers}
    assert json.loads(immediate.body)["error"]["code"] == "deflected"
