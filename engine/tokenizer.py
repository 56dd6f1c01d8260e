"""The engine tokenizer: text <-> token ids and chat rendering, over the Rust `tokenizers` library.

Built either from a GGUF file's metadata (llama.cpp stores the vocabulary, merges and special
token ids there) or from a Hugging Face folder's `tokenizer.json`. Only byte-level BPE
vocabularies (`tokenizer.ggml.model = gpt2`) are built from GGUF; each `tokenizer.ggml.pre`
names how llama.cpp splits text before BPE, and we rebuild that split with `tokenizers` parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from engine.chat_template import ChatMessage, ChatTemplate, TemplateValue
from engine.errors import UnsupportedModelError
from engine.gguf_file import GGUFFile, read_gguf
from engine.gguf_metadata import GGUFMetadata
from engine.hf_json import read_json_object

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Split regexes of the tokenizer.json files these vocabularies come from (as llama.cpp uses them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values, grouped by the pre-tokenizer llama.cpp gives them.
_GPT2_PRE = frozenset({"default", "gpt2", "mpt", "olmo", "jais"})
# GPT-2's split after putting every digit on its own (StarCoder's vocabulary, which SmolLM reuses).
_DIGITS_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "stablelm2"})


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Ids of the model's special tokens; `stop_ids` end a generation (eos and its kin)."""

    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    stop_ids: frozenset[int]
    add_bos: bool


class Tokenizer:
    """Encodes prompts, decodes outputs and renders chats exactly as the model's own tokenizer."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special: SpecialTokens,
        chat_template: ChatTemplate | None,
    ) -> None:
        self._backend = backend
        self._special = special
        self._chat_template = chat_template

    @classmethod
    def from_gguf(cls, file_or_path: GGUFFile | Path | str) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (byte-level BPE vocabularies only)."""
        gguf = file_or_path
        if not isinstance(gguf, GGUFFile):
            gguf = read_gguf(Path(gguf))
        meta = GGUFMetadata(gguf)
        kind = meta.string("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens = meta.strings("tokenizer.ggml.tokens")
        if not tokens:
            raise UnsupportedModelError("GGUF file has no tokenizer.ggml.tokens")
        backend = _byte_level_bpe(
            tokens,
            meta.strings("tokenizer.ggml.merges") or [],
            meta.integers("tokenizer.ggml.token_type") or [],
            meta.string("tokenizer.ggml.pre") or "default",
        )
        eos_id = meta.integer("tokenizer.ggml.eos_token_id")
        stops = {meta.integer(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")} | {eos_id}
        special = SpecialTokens(
            bos_id=meta.integer("tokenizer.ggml.bos_token_id"),
            eos_id=eos_id,
            unk_id=meta.integer("tokenizer.ggml.unknown_token_id"),
            pad_id=meta.integer("tokenizer.ggml.padding_token_id"),
            stop_ids=frozenset(i for i in stops if i is not None),
            # Like transformers: a byte-level vocabulary adds no BOS unless the file says so.
            add_bos=bool(meta.boolean("tokenizer.ggml.add_bos_token")),
        )
        source = meta.string("tokenizer.chat_template")
        return cls(backend, special, ChatTemplate(source) if source else None)

    @classmethod
    def from_hf_folder(cls, path: Path | str) -> Tokenizer:
        """Load `tokenizer.json` with `tokenizer_config.json` (and `generation_config.json`)."""
        folder = Path(path)
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the Rust library raises a bare Exception on bad files
            raise UnsupportedModelError(f"cannot read {folder / 'tokenizer.json'}: {exc}") from exc
        config = read_json_object(folder / "tokenizer_config.json", missing_ok=True)
        generation = read_json_object(folder / "generation_config.json", missing_ok=True)

        def token_id(key: str) -> int | None:
            content = _token_content(config.get(key))
            return backend.token_to_id(content) if content is not None else None

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        stops = {eos_id, *_ids(generation.get("eos_token_id"))}
        add_bos = config.get("add_bos_token")
        special = SpecialTokens(
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=token_id("unk_token"),
            pad_id=token_id("pad_token"),
            stop_ids=frozenset(i for i in stops if i is not None),
            add_bos=add_bos if isinstance(add_bos, bool) else _post_processor_adds(backend, bos_id),
        )
        source = _hf_chat_template(folder, config)
        return cls(backend, special, ChatTemplate(source) if source else None)

    @property
    def bos_token_id(self) -> int | None:
        return self._special.bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._special.eos_id

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._special.stop_ids

    def to_json(self) -> str:
        """The Rust tokenizer's own JSON form (what a grammar library builds its vocabulary
        from)."""
        return str(self._backend.to_str())

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it map to their ids.

        Releases the GIL while it encodes, so that encoding in a worker thread leaves the event
        loop running (the library's `encode` holds the GIL throughout: seconds for megabytes).
        """
        encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]
        ids: list[int] = encoding.ids
        if self._special.add_bos and self._special.bos_id is not None:
            return [self._special.bos_id, *ids]
        return ids

    @cached_property
    def split_points(self) -> tuple[str, ...] | None:
        """The added tokens' texts, if the ids of any text are the ids of its pieces between
        them (each added token standing for itself), encoded one by one and concatenated; None
        where an added token strips or normalizes its neighbours, so pieces would not add up.
        The region picker encodes a long prompt by pieces it has seen before this way."""
        added = self._backend.get_added_tokens_decoder().values()
        if any(t.lstrip or t.rstrip or t.single_word for t in added) or (
            self._backend.normalizer is not None and any(t.normalized for t in added)
        ):
            return None
        return tuple(sorted({t.content for t in added}, key=len, reverse=True))

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """The most UTF-8 bytes of text one token stands for, so that text of B bytes encodes to
        at least B / this many tokens; None where no such bound holds: only a byte-level
        vocabulary without a normalizer or whitespace-stripping added tokens tokenizes every byte
        of its input (others may drop or fuse text). Computed on first use (~0.1 s)."""
        backend = self._backend
        added = backend.get_added_tokens_decoder().values()
        if (
            not isinstance(backend.decoder, decoders.ByteLevel)
            or backend.normalizer is not None
            or any(token.lstrip or token.rstrip for token in added)
        ):
            return None
        # A byte-level token decodes to exactly its bytes (a partial UTF-8 sequence to U+FFFD,
        # longer than the bytes it stands for: the bound stays safe).
        return max(
            len(self.decode([token_id], skip_special_tokens=False).encode())
            for token_id in range(self.vocab_size)
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        token: str | None = self._backend.id_to_token(token_id)
        return token

    def with_chat_template(self, source: str) -> Tokenizer:
        """The same tokenizer with another chat template (an operator's override)."""
        return Tokenizer(self._backend, self._special, ChatTemplate(source))

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, TemplateValue]] | None = None,
    ) -> str:
        """The prompt text the model's chat template makes of a conversation."""
        if self._chat_template is None:
            raise UnsupportedModelError("this model has no chat template; send a plain prompt")
        return self._chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            variables=self._template_variables(),
        )

    def _template_variables(self) -> dict[str, TemplateValue]:
        # transformers passes the special tokens' text to templates under these names.
        names = {
            "bos_token": self._special.bos_id,
            "eos_token": self._special.eos_id,
            "unk_token": self._special.unk_id,
            "pad_token": self._special.pad_id,
        }
        variables: dict[str, TemplateValue] = {}
        for name, token_id in names.items():
            token = self.id_to_token(token_id) if token_id is not None else None
            if token is not None:
                variables[name] = token
        return variables


def _byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str
) -> tokenizers.Tokenizer:
    alphabet = _byte_alphabet()
    # A byte-level vocabulary spells every byte with a printable stand-in (space is "Ġ"). Some
    # converters store added tokens with raw characters instead; respell those the same way.
    vocab = {_respell(token, alphabet): index for index, token in enumerate(tokens)}
    pairs = [_merge_pair(merge) for merge in merges]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            fuse_unk=False,
            # Llama 3 style vocabularies look a whole pre-token up before merging (as llama.cpp).
            ignore_merges=pre in _LLAMA3_PRE,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, token_types, alphabet)
    return backend


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is None:
        known = sorted(_GPT2_PRE | _DIGITS_PRE | _LLAMA3_PRE | _QWEN2_PRE)
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(known)})"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_special_tokens(
    backend: tokenizers.Tokenizer,
    tokens: list[str],
    token_types: list[int],
    alphabet: frozenset[str],
) -> None:
    """Match control and user-defined tokens whole in text, so `<|im_start|>` encodes to its id.

    A control token spelled outside the byte alphabet is a converter's mislabel: adding it would
    give it a new id past the vocabulary, so it is skipped (as transformers does).
    """
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED and set(token) <= alphabet
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
    if backend.get_vocab_size(with_added_tokens=True) != backend.get_vocab_size(False):
        raise UnsupportedModelError("GGUF special tokens are not all in the vocabulary")


def _respell(token: str, alphabet: frozenset[str]) -> str:
    if set(token) <= alphabet:
        return token
    spelling = _byte_spelling()
    return "".join(spelling[byte] for byte in token.encode("utf-8"))


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise UnsupportedModelError(f"GGUF merge {merge!r} is not two tokens")
    return left, right


@cache
def _byte_spelling() -> tuple[str, ...]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, and the rest are shifted past 255 so that no byte is whitespace or a control."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling: dict[int, str] = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + shifted)
            shifted += 1
    return tuple(spelling[byte] for byte in range(256))


@cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_spelling())


def _token_content(value: object) -> str | None:
    # tokenizer_config.json writes a special token as its text or as a serialized AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: object) -> Iterable[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _post_processor_adds(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    """Whether `tokenizer.json`'s own post-processor puts BOS in front (Llama 3 style)."""
    if bos_id is None:
        return False
    ids: list[int] = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def _hf_chat_template(folder: Path, config: Mapping[str, object]) -> str | None:
    # transformers 5 saves the template as its own file; older folders keep it in the config,
    # either as one string or as a list of named templates.
    standalone = folder / "chat_template.jinja"
    if standalone.exists():
        return standalone.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                source = entry.get("template")
                return source if isinstance(source, str) else None
    return None
