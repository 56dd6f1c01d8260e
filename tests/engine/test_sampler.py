"""The batched sampler: each request's settings honoured, seeds reproducible per request."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import SamplingRequest, sample
from engine.sampling_params import SamplingParams

VOCAB = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def req(output_index: int = 0, **params: object) -> SamplingRequest:
    return SamplingRequest(SamplingParams(**params), output_index)  # type: ignore[arg-type]


def test_greedy_takes_the_argmax() -> None:
    x = logits(4)
    out = sample(x, [req(temperature=0) for _ in range(4)])
    assert out.token_ids == x.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy_even_when_hot() -> None:
    x = logits(6)
    requests = [req(temperature=5.0, top_k=1)] * 3 + [req(temperature=5.0, top_p=1e-6)] * 3
    for _ in range(5):
        assert sample(x, requests).token_ids == x.argmax(-1).tolist()


def test_top_k_and_top_p_never_sample_outside_their_sets() -> None:
    x = logits(1, seed=3)
    probs = x[0].softmax(-1)
    top3 = set(x[0].topk(3).indices.tolist())
    order = probs.argsort(descending=True).tolist()
    nucleus, mass = set(), 0.0
    for t in order:  # the smallest set reaching p = 0.6
        nucleus.add(t)
        mass += float(probs[t])
        if mass >= 0.6:
            break
    torch.manual_seed(0)
    for _ in range(300):
        assert sample(x, [req(temperature=1.0, top_k=3)]).token_ids[0] in top3
        assert sample(x, [req(temperature=1.0, top_p=0.6)]).token_ids[0] in nucleus


def test_unseeded_draws_follow_the_softmax() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.manual_seed(1234)
    counts = torch.zeros(4)
    draws = 4000
    for _ in range(draws):
        counts[sample(x, [req(temperature=1.0)]).token_ids[0]] += 1
    torch.testing.assert_close(counts / draws, x[0].softmax(-1), atol=0.03, rtol=0)


def test_temperature_sharpens_the_distribution() -> None:
    x = torch.tensor([[1.0, 0.0]])
    torch.manual_seed(7)
    cold = sum(sample(x, [req(temperature=0.25)]).token_ids[0] == 0 for _ in range(1000))
    hot = sum(sample(x, [req(temperature=4.0)]).token_ids[0] == 0 for _ in range(1000))
    assert cold > 950 and 500 < hot < 650  # softmax([4, 0]) ~ 0.98, softmax([0.25, 0]) ~ 0.56


def test_a_seed_gives_the_same_tokens_whatever_the_batch() -> None:
    x = logits(1, seed=5)
    alone = [sample(x, [req(i, temperature=1.0, seed=42)]).token_ids[0] for i in range(20)]
    crowd = logits(4, seed=6)
    crowd[2] = x[0]
    batched = [
        sample(
            crowd,
            [
                req(i, temperature=1.0),
                req(i, temperature=0.5, seed=1),
                req(i, temperature=1.0, seed=42),
                req(i, temperature=0),
            ],
        ).token_ids[2]
        for i in range(20)
    ]
    assert alone == batched
    other_seed = [sample(x, [req(i, temperature=1.0, seed=43)]).token_ids[0] for i in range(20)]
    assert other_seed != alone


def test_logprobs_are_the_models_log_softmax() -> None:
    x = logits(3)
    out = sample(
        x, [req(temperature=0, logprobs=4), req(temperature=0), req(temperature=0, logprobs=0)]
    )
    reference = x.log_softmax(-1)
    first = out.logprobs[0]
    assert first is not None and out.logprobs[1] is None
    assert first.logprob == pytest.approx(float(reference[0].max()), abs=1e-5)
    values, ids = reference[0].topk(4)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(values.tolist(), abs=1e-5)
    third = out.logprobs[2]
    assert third is not None and third.top == []


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"max_tokens": 0},
        {"logprobs": 21},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
    ],
)
def test_invalid_sampling_values_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)  # type: ignore[arg-type]
