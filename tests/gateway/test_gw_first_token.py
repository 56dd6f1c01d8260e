"""The first-byte timer waits for a stream's first token, not the chat role chunk a node sends
before its engine has done anything: a node that sends only that chunk and then hangs (its
engine stopped) is failed over within `first_byte_timeout_s`, for streams and non-streams alike,
and the answer names the region that really answered."""

from __future__ import annotations

import ssl
import time

import pytest
from gw_fleet import Fleet
from test_gw_resume import (
    CHAT,
    NUM_TOKENS,
    WHOLE_TEXT,
    Resumable,
    chunks_of,
    events_of,
    text_of,
    text_of_whole,
)

from gateway.calls import REGION_HEADER

IDLE_TIMEOUT_S = 60.0  # what a role-only stream waited before the fix
FIRST_BYTE_TIMEOUT_S = 1.0


@pytest.fixture
def regions(two_regions: Fleet, client_ssl: ssl.SSLContext) -> Resumable:
    for region in two_regions.regions.values():
        region.upstream.behavior.num_chunks = NUM_TOKENS
    _, secret = two_regions.create_key()
    return Resumable(two_regions, secret, client_ssl)


def hang_after_the_role_chunk(regions: Resumable) -> None:
    """us-east's node sends its chat role chunk, then nothing (its engine stopped)."""
    regions.near.behavior.stall_after_chunks = 0


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_non_stream_whose_node_sends_only_the_role_chunk_is_answered_by_the_next_region(
    regions: Resumable,
) -> None:
    gateway = regions.gateway(
        first_byte_timeout_s=FIRST_BYTE_TIMEOUT_S, stream_idle_timeout_s=IDLE_TIMEOUT_S
    )
    hang_after_the_role_chunk(regions)
    started_s = time.monotonic()
    response = regions.post(gateway, {**CHAT, "stream": False})
    took_s = time.monotonic() - started_s
    assert response.status_code == 200
    answer = response.json()
    assert text_of_whole(answer) == WHOLE_TEXT
    assert "meridian_resumes" not in answer  # failed over before it began, not resumed
    assert response.headers[REGION_HEADER] == "eu-west"
    assert regions.near.num_requests == 1 and regions.far.num_requests == 1
    assert took_s < IDLE_TIMEOUT_S / 2


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_stream_whose_node_sends_only_the_role_chunk_has_not_begun(regions: Resumable) -> None:
    gateway = regions.gateway(
        first_byte_timeout_s=FIRST_BYTE_TIMEOUT_S, stream_idle_timeout_s=IDLE_TIMEOUT_S
    )
    hang_after_the_role_chunk(regions)
    started_s = time.monotonic()
    response = regions.post(gateway, CHAT)
    took_s = time.monotonic() - started_s
    assert response.status_code == 200
    assert response.headers[REGION_HEADER] == "eu-west"
    chunks = chunks_of(response.text)
    assert text_of(chunks) == WHOLE_TEXT and events_of(response.text)[-1] == "[DONE]"
    assert {c["served_by"] for c in chunks} == {"eu-west"}  # not a byte of us-east's
    [final] = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]  # type: ignore[index]
    assert "meridian_resumes" not in final
    assert took_s < IDLE_TIMEOUT_S / 2


@pytest.mark.slow  # seconds of waiting on timeouts
@pytest.mark.parametrize("failure", ["die_after_chunks", "stall_after_chunks"])
def test_a_resumed_non_stream_names_the_region_that_finished_it(
    regions: Resumable, failure: str
) -> None:
    gateway = regions.gateway(stream_idle_timeout_s=0.5)
    setattr(regions.near.behavior, failure, 2)
    response = regions.post(gateway, {**CHAT, "stream": False})
    assert response.status_code == 200
    answer = response.json()
    assert text_of_whole(answer) == WHOLE_TEXT and answer["meridian_resumes"] == 1
    assert response.headers[REGION_HEADER] == "eu-west"


def test_a_stream_whose_node_sends_an_error_in_place_of_its_first_token_fails_over(
    regions: Resumable,
) -> None:
    gateway = regions.gateway()
    regions.near.behavior.error_after_chunks = 0  # the role chunk, then the engine's error
    response = regions.post(gateway, CHAT)
    assert response.status_code == 200
    assert response.headers[REGION_HEADER] == "eu-west"
    chunks = chunks_of(response.text)
    assert text_of(chunks) == WHOLE_TEXT and {c["served_by"] for c in chunks} == {"eu-west"}
    [final] = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]  # type: ignore[index]
    assert "meridian_resumes" not in final
