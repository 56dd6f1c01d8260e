"""PNG plots of one scenario's run (matplotlib, imported only when plots are asked for).

- `<scenario>_ttft_cdf.png`: the CDF of TTFT per policy (answered requests).
- `<scenario>_region_load.png`: requests per second each region took over time, per policy.
- `<scenario>_region_share.png`: each region's share of the requests, per policy.
- `<scenario>_placed_model.png` (a scenario with a placed model): its requests per second over
  time, per policy: answered by it, answered by a fallback, failed.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
import numpy as np
import numpy.typing as npt

from simulator.compare import ScenarioResult
from simulator.results import GOODPUT_TTFT_S, Recorder

NUM_TIME_BINS = 60


def _ttft_cdf(result: ScenarioResult, path: Path) -> None:
    figure, axes = plt.subplots(figsize=(8, 5))
    for policy, recorder in result.recorders.items():
        ttfts = np.sort(recorder.ok_ttfts_s())
        if ttfts.size:
            axes.plot(ttfts, np.arange(1, ttfts.size + 1) / ttfts.size, label=policy)
    axes.axvline(GOODPUT_TTFT_S, color="grey", linestyle=":", linewidth=1)
    axes.set_xscale("log")
    axes.set_xlabel("TTFT (s, log scale)")
    axes.set_ylabel("share of answered requests")
    axes.set_title(f"{result.scenario}: TTFT CDF (seed {result.seed})")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _time_edges(recorder: Recorder) -> npt.NDArray[np.float64]:
    """`NUM_TIME_BINS` equal bins over the run's arrivals."""
    return np.linspace(np.min(recorder.arrival_s), np.max(recorder.arrival_s), NUM_TIME_BINS + 1)


def _region_load(result: ScenarioResult, path: Path) -> None:
    recorders = result.recorders
    figure, rows = plt.subplots(
        len(recorders), 1, figsize=(9, 2.2 * len(recorders)), sharex=True, squeeze=False
    )
    for (policy, recorder), (axes,) in zip(recorders.items(), rows, strict=True):
        served = recorder.region >= 0
        edges = _time_edges(recorder)
        width_s = edges[1] - edges[0]
        for index, region in enumerate(recorder.regions):
            times = recorder.arrival_s[served & (recorder.region == index)]
            counts, _ = np.histogram(times, bins=edges)
            axes.plot(edges[:-1], counts / width_s, label=region, linewidth=1)
        axes.set_ylabel("req/s")
        axes.set_title(policy, fontsize=9, loc="left")
    rows[0][0].legend(ncol=4, fontsize=7, loc="upper right")
    rows[-1][0].set_xlabel("simulated time (s)")
    figure.suptitle(f"{result.scenario}: requests per region over time (seed {result.seed})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _region_share(result: ScenarioResult, path: Path) -> None:
    recorders = result.recorders
    regions = next(iter(recorders.values())).regions
    figure, axes = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(recorders)
    positions = np.arange(len(regions))
    for i, (policy, recorder) in enumerate(recorders.items()):
        counts = np.bincount(recorder.region[recorder.region >= 0], minlength=len(regions))
        axes.bar(positions + i * width, counts / max(1, int(counts.sum())), width, label=policy)
    axes.set_xticks(positions + width * (len(recorders) - 1) / 2, regions, rotation=20)
    axes.set_ylabel("share of requests")
    axes.set_title(f"{result.scenario}: traffic share per region (seed {result.seed})")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _placed_model(result: ScenarioResult, path: Path) -> None:
    placed = result.placed_model
    assert placed is not None
    recorders = result.recorders
    figure, rows = plt.subplots(
        len(recorders), 1, figsize=(9, 2.2 * len(recorders)), sharex=True, squeeze=False
    )
    for (policy, recorder), (axes,) in zip(recorders.items(), rows, strict=True):
        index = recorder.models.index(placed)
        asked = recorder.asked == index
        edges = _time_edges(recorder)
        width_s = edges[1] - edges[0]
        answered = recorder.answered[asked]
        for label, chosen in (
            (f"answered by {placed}", answered == index),
            ("answered by a fallback", (answered >= 0) & (answered != index)),
            ("failed", answered < 0),
        ):
            counts, _ = np.histogram(recorder.arrival_s[asked][chosen], bins=edges)
            axes.plot(edges[:-1], counts / width_s, label=label, linewidth=1)
        axes.set_ylabel("req/s")
        axes.set_title(policy, fontsize=9, loc="left")
    rows[0][0].legend(fontsize=7, loc="upper right")
    rows[-1][0].set_xlabel("simulated time (s)")
    figure.suptitle(f"{result.scenario}: requests for {placed} (seed {result.seed})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(result: ScenarioResult, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    drawings = [
        ("ttft_cdf", _ttft_cdf),
        ("region_load", _region_load),
        ("region_share", _region_share),
    ]
    if result.placed_model is not None:
        drawings.append(("placed_model", _placed_model))
    for suffix, draw in drawings:
        path = folder / f"{result.scenario}_{suffix}.png"
        draw(result, path)
        paths.append(path)
    return paths
