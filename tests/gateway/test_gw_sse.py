"""Reading upstream SSE on the way through: usage, first token, end, and hiding usage."""

from __future__ import annotations

import json

from gateway.sse import StreamReader, Usage, summed_usage

ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}],"usage":null}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + TOKEN + TOKEN + USAGE + DONE


def feed_all(reader: StreamReader, chunks: list[bytes]) -> bytes:
    return b"".join(reader.feed(chunk) for chunk in chunks) + reader.flush()


def test_usage_is_read_and_passed_on_when_the_client_asked() -> None:
    reader = StreamReader(strip_usage=False)
    assert feed_all(reader, [STREAM]) == STREAM
    assert reader.usage is not None and reader.usage.total_tokens == 5
    assert reader.is_done and reader.has_first_token
    assert reader.num_events == 5


def test_usage_reads_the_node_s_cached_prompt_tokens() -> None:
    details = USAGE.replace(b'"completion_tokens":2}', b'"completion_tokens":2,'
                            b'"prompt_tokens_details":{"cached_tokens":2}}')  # fmt: skip
    reader = StreamReader(strip_usage=False)
    assert feed_all(reader, [ROLE + TOKEN + details + DONE]) == ROLE + TOKEN + details + DONE
    assert reader.usage == Usage(3, 2, cached_tokens=2)
    plain = StreamReader(strip_usage=False)
    feed_all(plain, [STREAM])
    assert plain.usage == Usage(3, 2, cached_tokens=0)


def test_usage_is_hidden_when_the_client_did_not_ask() -> None:
    reader = StreamReader(strip_usage=True)
    out = feed_all(reader, [STREAM])
    assert b"usage" not in out
    assert (
        out == ROLE.replace(b',"usage":null', b"") + 2 * TOKEN.replace(b',"usage":null', b"") + DONE
    )
    assert reader.usage is not None and reader.usage.completion_tokens == 2


def test_events_split_across_reads_are_sent_whole_and_in_order() -> None:
    reader = StreamReader(strip_usage=True)
    pieces = [STREAM[i : i + 7] for i in range(0, len(STREAM), 7)]
    outputs = [reader.feed(piece) for piece in pieces]
    assert all(out == b"" or out.endswith(b"\n\n") for out in outputs)
    joined = b"".join(outputs) + reader.flush()
    assert joined.count(b"\n\n") == 4 and joined.endswith(DONE)
    assert reader.usage is not None


def test_the_role_chunk_is_not_the_first_token() -> None:
    reader = StreamReader(strip_usage=False)
    reader.feed(ROLE)
    assert not reader.has_first_token
    reader.feed(TOKEN)
    assert reader.has_first_token


def test_usage_inside_a_chunk_with_choices_keeps_the_choices() -> None:
    last = {
        "choices": [{"delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
    }
    event = b"data: " + json.dumps(last).encode() + b"\n\n"
    reader = StreamReader(strip_usage=True)
    out = reader.feed(event)
    assert json.loads(out[len(b"data: ") :]) == {"choices": last["choices"]}
    assert reader.usage is not None


def test_a_stream_cut_before_done_is_not_done() -> None:
    reader = StreamReader(strip_usage=False)
    reader.feed(ROLE + TOKEN[:10])
    assert not reader.is_done
    assert reader.flush() == TOKEN[:10]


def chunk(content: str, ids: list[int], cid: str = "c-1", created: int = 5) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": None, "token_ids": ids}
    payload = {"id": cid, "created": created, "choices": [choice]}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def finish(cid: str) -> bytes:
    choice = {"index": 0, "delta": {}, "finish_reason": "stop"}
    return b"data: " + json.dumps({"id": cid, "created": 9, "choices": [choice]}).encode() + b"\n\n"


def role(cid: str) -> bytes:
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}
    return b"data: " + json.dumps({"id": cid, "created": 9, "choices": [choice]}).encode() + b"\n\n"


def usage(prompt: int, completion: int, cid: str) -> bytes:
    body = {
        "id": cid,
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_token_ids_are_kept_and_hidden_unless_asked() -> None:
    reader = StreamReader(strip_usage=False)
    out = feed_all(
        reader,
        [role("c-1") + chunk("a", [7]) + chunk("b c", [8, 9])[:20], chunk("b c", [8, 9])[20:]],
    )
    assert reader.token_ids == [7, 8, 9]
    assert b"token_ids" not in out
    shown = StreamReader(strip_usage=False, strip_token_ids=False)
    assert b'"token_ids":[8,9]' in feed_all(shown, [chunk("b c", [8, 9])])


def test_an_upstream_error_event_is_held_back_with_what_follows() -> None:
    reader = StreamReader(strip_usage=False)
    error = b'data: {"error":{"message":"x","code":"engine_dead"}}\n\n' + DONE
    out = feed_all(reader, [chunk("a", [7]) + error])
    assert out == chunk("a", [7]).replace(b',"token_ids":[7]', b"")
    assert reader.upstream_error == error and not reader.is_done


def test_text_that_looks_like_an_error_event_is_content() -> None:
    reader = StreamReader(strip_usage=False)
    feed_all(reader, [chunk('data: {"error"', [7])])
    assert reader.upstream_error is None


def test_a_continuation_looks_like_the_first_attempt() -> None:
    reader = StreamReader(strip_usage=False)
    feed_all(reader, [role("first") + chunk("a", [7]) + chunk("b", [8]) + b'data: {"id":"fi'])
    reader.begin_continuation()
    out = feed_all(
        reader,
        [
            role("second")
            + chunk("c", [9], "second", 77)
            + finish("second")
            + usage(12, 1, "second")
            + DONE
        ],
    )
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert [e["id"] for e in events] == ["first"] * 3  # no second role chunk
    assert events[0]["choices"][0]["delta"] == {"content": "c"} and events[0]["created"] == 9
    assert events[1]["meridian_resumes"] == 1
    # The first attempt: prompt 10 and 2 tokens; the second: prompt 10 + 2 resumed, 1 token.
    assert events[2]["usage"]["prompt_tokens"] == 22
    assert events[2]["usage"]["completion_tokens"] == 3
    assert reader.token_ids == [7, 8, 9] and reader.starts == [0, 2] and reader.is_done


def test_summed_usage_counts_each_attempts_prompt_and_every_output_token_once() -> None:
    last = Usage(prompt_tokens=10 + 5, completion_tokens=4)  # resumed after 5 relayed
    assert summed_usage(last, [0, 2, 5]) == Usage(10 + 12 + 15, 9)


def with_prompt_ids(event: bytes, ids: list[int]) -> bytes:
    """`event` as a node's first chunk: the ids it prefilled at the top level."""
    encoded = json.dumps(ids, separators=(",", ":")).encode()
    return event.replace(b'"choices"', b'"prompt_token_ids":' + encoded + b', "choices"', 1)


def test_the_prompts_ids_are_counted_and_shown_once_only_to_a_client_that_asked() -> None:
    first = with_prompt_ids(role("c-1"), [1, 2, 3])
    hidden = StreamReader(strip_usage=False)
    assert b"prompt_token_ids" not in feed_all(hidden, [first + chunk("a", [7])])
    shown = StreamReader(strip_usage=False, strip_token_ids=False)
    assert b'"prompt_token_ids":[1,2,3]' in feed_all(shown, [first + chunk("a", [7])])
    shown.begin_continuation()  # the continuation's prompt (3 + the resumed 7) is not theirs
    again = with_prompt_ids(role("c-2"), [1, 2, 3, 7])
    assert b"prompt_token_ids" not in feed_all(shown, [again + chunk("b", [8])])


def test_a_stream_cut_between_finish_and_usage_gets_its_usage_from_what_was_read() -> None:
    reader = StreamReader(strip_usage=False)
    feed_all(reader, [with_prompt_ids(role("c-1"), [1, 2, 3]) + chunk("a", [7])])
    reader.begin_continuation()
    feed_all(
        reader, [with_prompt_ids(role("c-2"), [1, 2, 3, 7]) + chunk("b c", [8, 9]) + finish("c-2")]
    )
    assert reader.is_finished and reader.usage is None
    [event] = [e for e in reader.end_without_usage().split(b"\n\n") if e]
    payload = json.loads(event[len(b"data: ") :])
    # Attempt 1: prompt 3, 1 token; attempt 2: prompt 3 + 1 resumed, 2 tokens.
    assert payload["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert payload["choices"] == [] and payload["id"] == "c-1"
    assert "meridian_resumes" not in payload
    assert reader.usage == Usage(7, 3)
    hidden = StreamReader(strip_usage=True)
    feed_all(hidden, [with_prompt_ids(role("c-1"), [1, 2]) + chunk("a", [7]) + finish("c-1")])
    assert hidden.end_without_usage() == b"" and hidden.usage == Usage(2, 1)


def completion_chunk(tokens: list[str], offsets: list[int], cid: str) -> bytes:
    logprobs = {
        "tokens": tokens,
        "token_logprobs": [-0.5] * len(tokens),
        "top_logprobs": None,
        "text_offset": offsets,
    }
    choice = {"index": 0, "text": "".join(tokens), "logprobs": logprobs, "finish_reason": None}
    return b"data: " + json.dumps({"id": cid, "choices": [choice]}).encode() + b"\n\n"


def offsets_of(out: bytes) -> list[int]:
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    return [o for e in events for c in e["choices"] for o in c["logprobs"]["text_offset"]]


def test_a_resumed_completions_text_offset_counts_from_the_first_attempts_start() -> None:
    reader = StreamReader(strip_usage=False)
    first = feed_all(
        reader, [completion_chunk(["ab"], [0], "c-1") + completion_chunk(["c"], [2], "c-1")]
    )
    assert offsets_of(first) == [0, 2]
    reader.begin_continuation()  # the continuation's node counts from its own start: 0 again
    out = feed_all(
        reader, [completion_chunk(["de", "f"], [0, 2], "c-2") + completion_chunk(["g"], [3], "c-2")]
    )
    assert offsets_of(out) == [3, 5, 6]


def test_a_stream_of_n_choices_is_finished_once_every_choice_has_finished() -> None:
    """A break after choice 0's finish but before choice 1's is a break (its error shows), not
    a stream that lost only its usage chunk."""

    def finished(index: int) -> bytes:
        choice = {"index": index, "delta": {}, "finish_reason": "stop"}
        return b"data: " + json.dumps({"choices": [choice], "usage": None}).encode() + b"\n\n"

    reader = StreamReader(strip_usage=True, num_choices=2)
    feed_all(reader, [ROLE + TOKEN + finished(0) + TOKEN])
    assert not reader.is_finished
    feed_all(reader, [finished(1)])
    assert reader.is_finished
