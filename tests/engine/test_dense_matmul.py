"""The dense matmul: oneDNN's fp32 path from the measured crossover on, F.linear below it, the
same products either way; bf16's GEMV kernel range by the CPU's flags or, where they do not
settle it, by probes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import dense_matmul
from engine.model.dense_matmul import (
    bf16_gemv_max_tokens,
    dense_linear,
    onednn_min_tokens,
    packed,
    packs_bf16,
)

pytestmark = pytest.mark.skipif(not dense_matmul._ONEDNN, reason="torch built without oneDNN")


@pytest.fixture
def onednn_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the products that take oneDNN, with the crossover pinned at 4 tokens."""
    calls: list[int] = []
    real = dense_matmul._onednn_linear

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        calls.append(x.numel() // x.shape[-1])
        return real(x, weight, bias)

    monkeypatch.setattr(dense_matmul, "_onednn_linear", counted)
    monkeypatch.setattr(dense_matmul, "onednn_min_tokens", lambda k, n: 4)
    return calls


def test_steps_from_the_crossover_take_onednn_and_equal_f_linear(onednn_calls: list[int]) -> None:
    weight, bias = torch.randn(96, 80), torch.randn(96)
    for num_tokens in (1, 3, 4, 5, 257):
        x = torch.randn(num_tokens, 80)
        for b in (None, bias):
            torch.testing.assert_close(
                dense_linear(x, weight, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-4
            )
    assert onednn_calls == [4, 4, 5, 5, 257, 257]


def test_tokens_count_over_leading_dimensions(onednn_calls: list[int]) -> None:
    weight = torch.randn(32, 16)
    x = torch.randn(2, 3, 16)  # six tokens
    torch.testing.assert_close(dense_linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-4)
    assert onednn_calls == [6]


def test_bf16_above_the_gemv_kernel_keeps_f_linear(onednn_calls: list[int]) -> None:
    weight = torch.randn(32, 16, dtype=torch.bfloat16)
    x = torch.randn(bf16_gemv_max_tokens(32, 16) + 1, 16, dtype=torch.bfloat16)
    assert torch.equal(dense_linear(x, weight), F.linear(x, weight))
    assert onednn_calls == []


@pytest.mark.skipif(not packs_bf16(), reason="oneDNN does not multiply bf16 on this CPU")
@pytest.mark.parametrize("num_tokens", [1, 17, 300])
def test_a_packed_bf16_weight_multiplies_as_the_plain_one(
    onednn_calls: list[int], num_tokens: int
) -> None:
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    kept = packed(weight)
    assert kept.is_mkldnn and not packed(weight.float()).is_mkldnn
    x = torch.randn(num_tokens, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(dense_linear(x, kept, bias), F.linear(x, weight, bias))
    assert onednn_calls == [num_tokens]


@pytest.mark.parametrize(("amx", "avx512_bf16"), [(True, True), (False, False)])
def test_the_bf16_gemv_range_is_4_where_the_cpu_s_flags_settle_it(
    monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(dense_matmul, "median_s", lambda call: pytest.fail("probed"))
    bf16_gemv_max_tokens.cache_clear()
    try:
        assert bf16_gemv_max_tokens(64, 128) == 4
    finally:
        bf16_gemv_max_tokens.cache_clear()


@pytest.mark.parametrize(
    ("kernel_wins_to", "expected", "probes", "most_macs"),
    [
        (0, 4, [8], None),
        (8, 8, [8, 16], None),
        (16, 16, [8, 16, 32], None),
        (32, 32, [8, 16, 32, 64], None),
        (64, 64, [8, 16, 32, 64], None),
        # Probes stop where they would cost more (the LM head's): the range is the last one run.
        (64, 16, [8, 16], 16 * 64 * 128),
    ],
)
def test_the_bf16_gemv_range_is_the_last_probe_the_kernel_won(
    monkeypatch: pytest.MonkeyPatch,
    kernel_wins_to: int,
    expected: int,
    probes: list[int],
    most_macs: int | None,
) -> None:
    """With AVX-512 BF16 alone, each probe times the kernel and F.linear on cold copies of
    the weight; the range ends before the first probe the kernel loses by more than 10%."""
    if dense_matmul.cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built")
    monkeypatch.delenv("MERIDIAN_MATMUL_CROSSOVER", raising=False)
    if most_macs is not None:
        monkeypatch.setattr(dense_matmul, "_MAX_PROBE_MACS", most_macs)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    probed: list[tuple[str, int, int]] = []

    def tagged(linear, x, weights):  # type: ignore[no-untyped-def]
        path = "F.linear" if linear is F.linear else "kernel"
        return path, x.shape[0], len(weights)

    def timed(call: tuple[str, int, int]) -> float:
        probed.append(call)
        path, num_tokens, _ = call
        if path == "F.linear":
            return 1.0
        return 1.05 if num_tokens <= kernel_wins_to else 1.15  # within the band, then out

    monkeypatch.setattr(dense_matmul, "_cycling", tagged)
    monkeypatch.setattr(dense_matmul, "median_s", timed)
    bf16_gemv_max_tokens.cache_clear()
    try:
        assert bf16_gemv_max_tokens(64, 128) == expected
    finally:
        bf16_gemv_max_tokens.cache_clear()
    assert [n for path, n, _ in probed if path == "kernel"] == probes
    assert [n for path, n, _ in probed if path == "F.linear"] == probes
    # Enough copies of the weight to pass the caches.
    assert {copies for _, _, copies in probed} == {dense_matmul._COLD_BYTES // (2 * 64 * 128)}


def test_a_cycling_call_takes_the_next_weight_each_time() -> None:
    """The bf16 probes time cold weights: each call multiplies by the next copy, round the list
    (the suite pins the crossover, so no engine start probes for real)."""
    weights = [torch.full((1, 2), float(i)) for i in range(3)]
    call = dense_matmul._cycling(F.linear, torch.ones(1, 2), weights)
    assert [torch.as_tensor(call()).item() for _ in range(4)] == [0.0, 2.0, 4.0, 0.0]


def test_the_crossover_is_a_probe_or_never(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MERIDIAN_MATMUL_CROSSOVER", raising=False)
    onednn_min_tokens.cache_clear()
    try:
        assert onednn_min_tokens(64, 128) in (None, *dense_matmul._PROBE_TOKENS)
        assert onednn_min_tokens.cache_info().currsize == 1
    finally:
        onednn_min_tokens.cache_clear()


def test_a_pinned_crossover_is_taken_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    """MERIDIAN_MATMUL_CROSSOVER (the test suite's) stands for both measurements."""
    monkeypatch.setenv("MERIDIAN_MATMUL_CROSSOVER", "12")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(dense_matmul, "median_s", lambda call: pytest.fail("probed"))
    onednn_min_tokens.cache_clear()
    bf16_gemv_max_tokens.cache_clear()
    try:
        assert onednn_min_tokens(64, 128) == 12
        if dense_matmul.cpu_kernels() is not None:
            assert bf16_gemv_max_tokens(64, 128) == 12
    finally:
        onednn_min_tokens.cache_clear()
        bf16_gemv_max_tokens.cache_clear()


@pytest.mark.parametrize("value", ["0", "sixteen", "-3"])
def test_a_bad_pinned_crossover_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MERIDIAN_MATMUL_CROSSOVER", value)
    with pytest.raises(ValueError, match="MERIDIAN_MATMUL_CROSSOVER must be a number of tokens"):
        dense_matmul.pinned_crossover()
