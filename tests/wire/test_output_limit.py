"""The output-limit rule both the gateway and the node read OpenAI's two names by."""

from __future__ import annotations

from collections.abc import Callable

from wire.output_limit import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_output_limit,
    completions_output_limit,
    set_output_limit,
)


def test_chat_reads_the_newer_name_first_and_the_older_only_without_it() -> None:
    def reader(body: dict[str, int | None]) -> Callable[[str], int | None]:
        def read(name: str) -> int | None:
            names_read.append(name)
            return body.get(name)

        return read

    names_read: list[str] = []
    assert chat_output_limit(reader({"max_completion_tokens": 5, "max_tokens": 9})) == 5
    assert names_read == ["max_completion_tokens"]
    assert chat_output_limit(reader({"max_completion_tokens": None, "max_tokens": 9})) == 9
    assert chat_output_limit(reader({})) is None


def test_completions_default_to_openais_sixteen() -> None:
    assert COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert completions_output_limit(None) == 16
    assert completions_output_limit(3) == 3


def test_the_limit_is_written_under_the_names_the_body_uses() -> None:
    older: dict[str, object] = {"model": "m"}
    set_output_limit(older, 7)
    assert older == {"model": "m", "max_tokens": 7}
    newer: dict[str, object] = {"max_completion_tokens": None, "model": "m"}
    set_output_limit(newer, 7)
    assert newer == {"max_completion_tokens": 7, "model": "m", "max_tokens": 7}
