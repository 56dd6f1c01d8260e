"""A PoP's own paths to the regions (`--region-ingress`) and the edge flags: parsed from the
command line, bad ones refused in one line; the summaries' ingress URLs replaced for the named
regions only."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from gateway.__main__ import load_settings, main, parse_args
from gateway.region_ingress import with_region_ingress
from wire.region_summary import QueueEstimate, RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy

TOKEN = "gw-" + "x" * 30
BASE = ("--pop", "london", "--control-plane", "http://127.0.0.1:1", "--plain")


@pytest.fixture(autouse=True)
def keep_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", TOKEN)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _summary(name: str, url: str | None) -> RegionSummary:
    queue = QueueEstimate(
        num_waiting=0, num_waiting_prefill_tokens=0, decode_tokens_per_s=0, expected_queue_delay_s=0
    )
    return RegionSummary(
        name=name,
        lat=0,
        lon=0,
        state="active",
        ingress_url=url,
        healthy_nodes=1,
        kv_blocks_free=1,
        kv_blocks_total=1,
        queue=queue,
        weight=1,
    )


def test_the_named_regions_take_this_pops_paths() -> None:
    document = RegionSummaryIndex(
        index=3,
        regions=[
            _summary("us-east", "http://127.0.0.1:10201"),
            _summary("eu-west", "http://127.0.0.1:10202"),
            _summary("unrouted", None),
        ],
        routing=RoutingPolicy(),
    )
    ingress = {"us-east": "http://127.0.0.1:10301", "unrouted": "http://127.0.0.1:9"}
    replaced = with_region_ingress(document, ingress)
    assert [r.ingress_url for r in replaced.regions] == [
        "http://127.0.0.1:10301",
        "http://127.0.0.1:10202",  # not named: as registered
        None,  # no ingress registered: still not routable
    ]
    assert replaced.index == 3
    assert with_region_ingress(document, {}) == document


def test_flags_become_settings() -> None:
    args = parse_args(
        [
            *BASE,
            *("--region-ingress", "us-east=http://127.0.0.1:10301"),
            *("--region-ingress", "eu-west=http://127.0.0.1:10302"),
            *("--auto-model", "m", "--edge-url", "http://127.0.0.1:9501"),
            *("--edge-max-tokens", "16", "--edge-policy", "key-1=forbid"),
        ]
    )
    settings = load_settings(args)
    assert settings.region_ingress == {
        "us-east": "http://127.0.0.1:10301",
        "eu-west": "http://127.0.0.1:10302",
    }
    assert (settings.auto_model, settings.edge_url, settings.edge_max_tokens) == (
        "m",
        "http://127.0.0.1:9501",
        16,
    )
    assert settings.edge_policy == {"key-1": "forbid"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--region-ingress", "us-east"), "expected NAME=VALUE"),
        (("--region-ingress", "us-east=ftp://x"), "is not an http(s):// URL"),
        (("--edge-url", "http://127.0.0.1:9501"), "--edge-url needs --auto-model"),
        (("--auto-model", "m", "--edge-policy", "k=always"), "edge_policy.k"),
    ],
)
def test_bad_flags_fail_in_one_line(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    assert main([*BASE, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
