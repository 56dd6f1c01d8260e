"""The picker's block hashes of a chat equal the engine's own for the same prompt, salt and
block size, on the real default model's tokenizer; a repeated system prompt is not encoded
again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tiny_checkpoints import write_tiny_tokenizer

from engine.kv_cache_manager import KVCacheManager
from engine.loader import Checkpoint
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from region_picker.picker import parse_prompt
from region_picker.prompt_hashes import PromptHasher
from wire.model_catalog import MODEL_HEADER

SYSTEM = "You are the support assistant of Meridian. Answer briefly, cite the docs. " * 60
CHATS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do I drain a node?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "日本語 🤖 x² ①"}],
    [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "<|im_end|> and 3?"},
    ],
    [{"role": "user", "content": "What is the capital of France?"}],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint: Checkpoint) -> Tokenizer:
    return smollm2_checkpoint.tokenizer


def engine_hashes(
    tokenizer: Tokenizer, chat: list[dict[str, str]], salt: str | None
) -> list[bytes]:
    """What the node agent and the engine make of the chat: rendered, encoded, and the full
    blocks hashed by the KV cache manager itself."""
    chat = [m | {"role": "system"} if m["role"] == "developer" else m for m in chat]
    ids = tokenizer.encode(tokenizer.render_chat(chat, add_generation_prompt=True))
    return engine_block_hashes(ids, 16, salt)


def engine_block_hashes(ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """The KV cache manager's own hashes of the prompt's full blocks."""
    # One token more, as once the first output is sampled: every prompt block is full then.
    seq = Sequence("r", ids + [0], SamplingParams(max_tokens=1), 1, cache_salt=salt)
    KVCacheManager(num_blocks=1024, block_size=block_size).get_computed_blocks(seq)
    assert len(seq.block_hashes) == len(ids) // block_size
    return seq.block_hashes


@pytest.mark.parametrize("salt", [None, "tenant-a", "tenant-b"])
def test_chat_hashes_equal_the_engines(tokenizer: Tokenizer, salt: str | None) -> None:
    hasher = PromptHasher(tokenizer, block_size=16)
    for _ in range(2):  # cold, then from the memo of the leading pieces
        for chat in CHATS:
            body = {"model": "smollm2-135m-instruct", "messages": chat}
            prompt = parse_prompt({}, _json(body))
            assert prompt is not None and prompt.messages is not None
            assert hasher.chat_hashes(prompt.messages, salt) == engine_hashes(tokenizer, chat, salt)
    assert hasher.num_memo_hits >= len(CHATS)


def test_salts_make_chains_apart(tokenizer: Tokenizer) -> None:
    hasher = PromptHasher(tokenizer, block_size=16)
    a = hasher.chat_hashes(CHATS[0], "tenant-a")
    b = hasher.chat_hashes(CHATS[0], "tenant-b")
    assert len(a) == len(b) > 50 and not set(a) & set(b)


def test_a_repeated_system_prompt_is_fast(tokenizer: Tokenizer) -> None:
    """Measured, not asserted on time: the memo is what makes it cheap."""
    hasher = PromptHasher(tokenizer, block_size=16)
    hasher.chat_hashes(CHATS[0], "t")
    started = time.perf_counter()
    for i in range(200):
        chat = [CHATS[0][0], {"role": "user", "content": f"question {i}"}]
        hasher.chat_hashes(chat, "t")
    per_call_ms = (time.perf_counter() - started) / 200 * 1e3
    num_blocks = len(hasher.chat_hashes(CHATS[0], "t"))
    print(f"chat_hashes of a {num_blocks}-block chat: {per_call_ms:.3f} ms")
    assert hasher.num_memo_hits >= 200


def test_the_model_comes_from_the_header_first() -> None:
    body = _json({"model": "alias", "prompt": "hi"})
    prompt = parse_prompt({MODEL_HEADER: "served"}, body)
    assert prompt is not None and (prompt.model, prompt.text) == ("served", "hi")
    assert parse_prompt({}, b"{not json") is None
    assert parse_prompt({}, _json({"messages": [{"content": "no role"}]})) is None
    parts = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]
    }
    prompt = parse_prompt({}, _json(parts))
    assert prompt is not None and prompt.messages == [{"role": "user", "content": "ab"}]


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


@pytest.mark.parametrize("bos_by_post_processor", [False, True])
def test_hashes_equal_the_engines_for_a_tokenizer_that_adds_bos(
    tmp_path: Path, bos_by_post_processor: bool
) -> None:
    write_tiny_tokenizer(tmp_path, bos_by_post_processor=bos_by_post_processor)
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert (tokenizer.encode("") != []) == bos_by_post_processor
    hasher = PromptHasher(tokenizer, block_size=4)
    system = {"role": "system", "content": "shared-prefix-" * 8}
    for _ in range(2):
        for question in ("a?", "bb?", "</s>ccc?"):
            chat = [system, {"role": "user", "content": question}]
            text = tokenizer.render_chat(chat, add_generation_prompt=True)
            expected = engine_block_hashes(tokenizer.encode(text), 4, "salt")
            assert hasher.chat_hashes(chat, "salt") == expected
    assert hasher.num_memo_hits >= 3
