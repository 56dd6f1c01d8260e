"""The tokenizer, detokenizer and chat templates, checked against transformers on the real model."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.chat_template import ChatTemplate
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.loader import Checkpoint
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\r\n\n\n  indented",
    "naïve café, Ærøskøbing, Straße, ĳ",
    "日本語のテキストと中文",
    "emoji 🤖🚀 flags 🇫🇷 family 👨‍👩‍👧 skin 👍🏽",
    "math 𝔘𝔫𝔦 ∑∫√ and ﷺ",
    "numbers 12345 3.14159 -0.5e10 1,000,000",
    "other numbers x² ①② ٣٤ Ⅻ, each on its own",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x",
    "I'm sure you'll see it's 'quoted' and DON'T",
    "a" * 300,
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 🤖 × 3?\n\nExplain."},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "  spaces  "},
        {"role": "assistant", "content": "ok"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint: Checkpoint) -> Tokenizer:
    return smollm2_checkpoint.tokenizer


# --- facts about the real model (docs/notes/MODEL.md) ---


@pytest.mark.slow
def test_special_tokens_are_smollm2s(tokenizer: Tokenizer) -> None:
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == 2
    assert tokenizer.stop_token_ids == frozenset({2})
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    # SmolLM2 adds no BOS to a prompt.
    assert tokenizer.encode("Hi")[0] != 1


@pytest.mark.slow
def test_every_number_is_split_from_what_precedes_it(tokenizer: Tokenizer) -> None:
    # As SmolLM2's tokenizer.json and llama.cpp's `smollm` split, any number, not only 0-9:
    # GPT-2's split alone would merge the space with the "²"'s first byte ("ĠÂ", 3351).
    assert tokenizer.encode(" ²") == [216, 19133]
    assert tokenizer.encode(" 12") == [216, 33, 34]


@pytest.mark.slow
def test_the_known_prompt_renders_to_37_tokens(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "You are a helpful AI assistant named SmolLM" in prompt
    ids = tokenizer.encode(prompt)
    assert len(ids) == 37
    assert ids[:4] == [1, 9690, 198, 2683]
    assert ids[-4:] == [1, 520, 9531, 198]


# --- against transformers ---


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(
    tokenizer: Tokenizer, hf_smollm2_tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_smollm2_tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_smollm2_tokenizer.decode(ids)
    assert tokenizer.decode(ids) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=60))
@example(text=" ²")  # found by hypothesis: a space before a number other than 0-9 (conftest)
def test_encode_matches_transformers_on_any_text(
    tokenizer: Tokenizer, hf_smollm2_tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    assert tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_renders_exactly_as_transformers(
    tokenizer: Tokenizer,
    hf_smollm2_tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    expected = hf_smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected


FEATURE_TEMPLATE = """\
{%- set ns = namespace(count=0) -%}
{{ bos_token }}
{% for message in messages %}
  {% if message.role == 'system' %}{% continue %}{% endif %}
  {% set ns.count = ns.count + 1 %}
  [{{ ns.count }}] {{ message.role }}: {{ message.content | trim }}
  {% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}
  {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant{{ eos_token }}{% endif %}
"""


@pytest.mark.slow
def test_template_features_render_as_transformers(
    tokenizer: Tokenizer, hf_smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "hidden"},
        {"role": "user", "content": "  <b>Tom & Jerry</b> café  "},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "args": {"x": "é"}}]},
    ]
    tools: list[Any] = [{"type": "function", "function": {"name": "f", "description": "<&> ü"}}]
    ours = tokenizer.with_chat_template(FEATURE_TEMPLATE).render_chat(messages, tools=tools)
    theirs = hf_smollm2_tokenizer.apply_chat_template(
        messages, chat_template=FEATURE_TEMPLATE, tools=tools, add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    assert ours == theirs
    assert '"é"' in ours  # tojson keeps non-ASCII and does not HTML-escape


@pytest.mark.slow
def test_hf_folder_tokenizer_matches_transformers(
    hf_smollm2_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_hf_folder(tmp_path)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert ours.stop_token_ids == frozenset({0, 2})
    for text in TEXTS:
        assert ours.encode(text) == hf_smollm2_tokenizer.encode(text)
    for messages in CONVERSATIONS:
        assert ours.render_chat(messages) == hf_smollm2_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )


# --- decoding and streaming ---


@pytest.mark.slow
@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t and "<repo" not in t])
def test_decode_round_trips_plain_text(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.slow
def test_decode_keeps_or_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"
    assert tokenizer.decode(ids) == "assistant\nHi"


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.push(token_id) for token_id in ids]
    return [*deltas, detokenizer.finish()]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_add_up_to_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    for skip in (True, False):
        deltas = stream(tokenizer, ids, skip)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.slow
def test_streaming_holds_back_a_character_split_across_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("go 🤖!")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert sum("\ufffd" in piece for piece in pieces) >= 2  # the robot spans several tokens
    deltas = stream(tokenizer, ids)
    assert "" in deltas[:-1]  # held back while incomplete
    assert deltas[:-1] == ["go", "", "", " 🤖", "!"]  # the space rides with the robot
    assert "".join(deltas) == "go 🤖!"


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=12))
def test_streamed_deltas_add_up_for_any_ids(tokenizer: Tokenizer, ids: list[int]) -> None:
    # Random ids include lone UTF-8 continuation bytes and special tokens.
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)
    assert "".join(stream(tokenizer, ids, False)) == tokenizer.decode(ids, False)


# --- chat template errors ---


def test_template_raise_exception_is_an_invalid_request() -> None:
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "ok"
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_template_type_errors_and_empty_chats_are_invalid_requests() -> None:
    template = ChatTemplate("{{ messages[0].content + '!' }}")
    with pytest.raises(InvalidRequestError):
        template.render([{"role": "user", "content": ["a", "list"]}])
    with pytest.raises(InvalidRequestError):
        template.render([])


def test_template_that_does_not_compile_is_unsupported() -> None:
    with pytest.raises(UnsupportedModelError, match="chat template"):
        ChatTemplate("{% for m in messages %}")


def test_template_sandbox_blocks_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([{"role": "user", "content": "x"}])


def test_strftime_now_and_generation_tags_work() -> None:
    template = ChatTemplate("{% generation %}{{ strftime_now('%Y') }}{% endgeneration %}")
    assert template.render([{"role": "user", "content": "x"}]) == str(datetime.now().year)


# --- GGUF vocabularies other than SmolLM2's (tiny files written here) ---

# Single characters for a byte-level vocabulary: printable ASCII; space is spelled "Ġ".
BASE_TOKENS = ["<s>", "</s>", "Ġ", *[chr(c) for c in range(ord("!"), ord("~") + 1)]]


def write_vocab_gguf(
    path: Path, *, model: str = "gpt2", pre: str = "gpt2", merges: list[str] | None = None,
    extra: list[str] | None = None,
) -> Path:  # fmt: skip
    tokens = BASE_TOKENS + [m.replace(" ", "") for m in merges or []] + (extra or [])
    types = [3, 3] + [1] * (len(tokens) - 2)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges or [])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Ranked so that "34" merges first: a split that keeps "12345" whole yields 12|34|5.
DIGIT_MERGES = ["3 4", "1 2", "4 5", "12 3"]


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["12", "34", "5"]),  # one pre-token: merges run over all five digits
        ("llama-bpe", ["123", "45"]),  # digits split in groups of three
        ("smollm", ["1", "2", "3", "4", "5"]),  # every digit alone
        ("qwen2", ["1", "2", "3", "4", "5"]),
    ],
)
def test_gguf_pre_tokenizer_splits_like_llama_cpp(
    tmp_path: Path, pre: str, pieces: list[str]
) -> None:
    path = write_vocab_gguf(tmp_path / "v.gguf", pre=pre, merges=DIGIT_MERGES)
    tokenizer = Tokenizer.from_gguf(path)
    ids = tokenizer.encode("12345")
    assert ids[0] == 0  # the file asks for BOS
    assert [tokenizer.id_to_token(i) for i in ids[1:]] == pieces
    assert tokenizer.decode(ids) == "12345"


def test_gguf_control_tokens_encode_whole(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "v.gguf"))
    assert tokenizer.encode("a</s>b") == [0, BASE_TOKENS.index("a"), 1, BASE_TOKENS.index("b")]
    assert tokenizer.stop_token_ids == frozenset({1})


def test_sentencepiece_gguf_vocab_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "v.gguf", model="llama"))


def test_unknown_gguf_pre_tokenizer_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'chameleon'"):
        Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "v.gguf", pre="chameleon"))


def test_model_without_chat_template_cannot_render(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "v.gguf"))
    assert not tokenizer.has_chat_template
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
