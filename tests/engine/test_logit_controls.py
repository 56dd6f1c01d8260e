"""The sampler's logit controls: penalties, logit_bias, min_tokens and grammar masks, each on
the rows that ask for it only."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import RequestRejected
from engine.grammar import GrammarMatcher
from engine.grammar_spec import GrammarSpec
from engine.request_limits import RequestLimits
from engine.sampler import SamplingRequest, process_logits, sample
from engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 63


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def req(
    token_ids: list[int] | None = None, num_output: int = 0, **params: object
) -> SamplingRequest:
    return SamplingRequest(SamplingParams(**params), num_output, token_ids)  # type: ignore[arg-type]


class AllowOnly(GrammarMatcher):
    """A matcher that allows a fixed set of tokens (the engine's come from llguidance)."""

    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor(words, dtype=torch.int64).to(torch.int32)


def test_frequency_penalty_lowers_each_seen_token_by_its_count() -> None:
    x = logits(2)
    history = [1, 2, 5, 5, 5]  # prompt [1, 2], output [5, 5, 5]
    out = process_logits(
        x.clone(), [req(history, 3, frequency_penalty=1.0), req(history, 3)], frozenset()
    )
    expected = x[0].clone()
    expected[5] -= 3.0
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], x[1])  # a row without penalties is untouched


def test_presence_and_repetition_penalties() -> None:
    x = logits(1)
    history = [1, 2, 5, 5]
    [pres] = process_logits(x.clone(), [req(history, 2, presence_penalty=0.5)], frozenset())
    assert pres[5] == pytest.approx(x[0, 5] - 0.5) and pres[1] == x[0, 1]  # output only
    [rep] = process_logits(x.clone(), [req(history, 2, repetition_penalty=2.0)], frozenset())
    for t in (1, 2, 5):  # prompt and output
        value = x[0, t]
        assert rep[t] == pytest.approx(value / 2 if value > 0 else value * 2)
    assert rep[7] == x[0, 7]


def test_logit_bias_forces_and_forbids_tokens_in_its_row_only() -> None:
    x = logits(3)
    top = int(x[1].argmax())
    out = sample(
        x.clone(),
        [
            req(temperature=0, logit_bias={17: 100.0}),
            req(temperature=0, logit_bias={top: -100.0}),
            req(temperature=0),
        ],
    )
    assert out.token_ids[0] == 17
    assert out.token_ids[1] != top
    assert out.token_ids[2] == int(x[2].argmax())


def test_min_tokens_hold_back_eos_and_stop_token_ids_until_reached() -> None:
    x = logits(1)
    x[0, EOS] = 50.0
    x[0, 9] = 40.0
    early = [req(None, 1, temperature=0, min_tokens=3, stop_token_ids=[9])]
    assert sample(x.clone(), early, frozenset({EOS})).token_ids[0] not in (EOS, 9)
    late = [req(None, 3, temperature=0, min_tokens=3, stop_token_ids=[9])]
    assert sample(x.clone(), late, frozenset({EOS})).token_ids == [EOS]


def test_grammar_masks_apply_to_constrained_rows_only_greedy_and_sampled() -> None:
    x = logits(4)
    allowed = [3, 40, 41]
    requests = [
        SamplingRequest(SamplingParams(temperature=0), 0, None, AllowOnly(allowed)),
        req(temperature=0),
        SamplingRequest(SamplingParams(temperature=1.0, seed=1), 0, None, AllowOnly(allowed)),
        req(temperature=1.0, seed=2),
    ]
    out = sample(x.clone(), requests)
    assert out.token_ids[0] == max(allowed, key=lambda t: float(x[0, t]))
    assert out.token_ids[2] in allowed
    alone = sample(x[[1, 3]].clone(), [requests[1], requests[3]])
    assert [out.token_ids[1], out.token_ids[3]] == alone.token_ids


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_out_of_range_controls_are_refused_naming_the_param(
    params: dict[str, object], param: str
) -> None:
    with pytest.raises(RequestRejected) as caught:
        SamplingParams(**params)  # type: ignore[arg-type]
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("grammar", "param", "words"),
    [
        (GrammarSpec("json_schema", '{"type": "strin"}'), "response_format", "strin"),
        (GrammarSpec("json_schema", "not json"), "response_format", "invalid json schema"),
        (GrammarSpec("regex", "a(b"), "guided_regex", "unclosed group"),
        (GrammarSpec("choice", json.dumps([])), "guided_choice", "non-empty"),
    ],
)
def test_bad_grammars_and_out_of_vocabulary_bias_are_refused_at_the_front(
    grammar: GrammarSpec, param: str, words: str
) -> None:
    limits = RequestLimits(max_model_len=100, vocab_size=VOCAB)
    with pytest.raises(RequestRejected, match=words) as caught:
        limits.check([1, 2], SamplingParams(grammar=grammar))
    assert caught.value.param == param
    with pytest.raises(RequestRejected) as caught:
        limits.check([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert caught.value.param == "logit_bias"
