"""`Tokenizer.max_bytes_per_token`: a bound only where every byte of the input becomes part of a
token, on small byte-level vocabularies built here."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from engine.tokenizer import SpecialTokens, Tokenizer

NO_SPECIALS = SpecialTokens(None, None, None, None, frozenset(), add_bos=False)


def byte_level_backend() -> tokenizers.Tokenizer:
    """Every byte a token, plus "Ġhello" (6 bytes: a space and "hello") from merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    merges = [("h", "e"), ("he", "l"), ("hel", "l"), ("hell", "o"), ("Ġ", "hello")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def test_a_byte_level_vocabulary_is_bounded_by_its_longest_token() -> None:
    backend = byte_level_backend()
    tokenizer = Tokenizer(backend, NO_SPECIALS, None)
    assert tokenizer.max_bytes_per_token == len(" hello")
    assert len(tokenizer.encode(" hello" * 10)) == 10  # the bound is met, never beaten
    backend.add_special_tokens([AddedToken("<|a-long-control-token|>", special=True)])
    assert Tokenizer(backend, NO_SPECIALS, None).max_bytes_per_token == 24


@pytest.mark.parametrize("change", ["normalizer", "stripping_added_token", "other_decoder"])
def test_no_bound_where_text_may_vanish_into_fewer_tokens(change: str) -> None:
    backend = byte_level_backend()
    if change == "normalizer":
        backend.normalizer = normalizers.Strip()
    elif change == "stripping_added_token":
        backend.add_tokens([AddedToken("<sep>", rstrip=True)])
        swallowed = Tokenizer(backend, NO_SPECIALS, None).encode("<sep>" + " " * 100)
        assert len(swallowed) == 1  # a hundred spaces gone into one 5-byte token
    else:
        backend.decoder = decoders.Metaspace()
    assert Tokenizer(backend, NO_SPECIALS, None).max_bytes_per_token is None
