"""The region picker in a simulated region: the node is chosen by region_picker/scoring.py
itself, from each node's true queue and prefix cache, and on `prefix_heavy` it finds the
cached system prompts that least request misses; a request whose gateway knows a sooner region
goes back to it (wire/deflection.py)."""

from __future__ import annotations

import random

import pytest

import region_picker.scoring
from simulator import node_picker
from simulator.calibration import ServiceCalibration
from simulator.compare import run_scenario
from simulator.events import EventLoop
from simulator.models import DEFAULT_MODEL
from simulator.node import Job, Node
from simulator.run import WorldOptions
from simulator.scenarios import SCENARIOS
from simulator.site import Site
from wire.geo import Location

CAL = ServiceCalibration(prefill_tokens_per_s=1000.0, step_base_s=0.05, step_per_seq_s=0.01)
SYSTEM_PROMPT_TOKENS = 1024


def site_with_picker(num_nodes: int) -> Site:
    loop = EventLoop()
    nodes = [
        Node(f"n{i}", "r", CAL, loop, lambda job: None, lambda job: None) for i in range(num_nodes)
    ]
    picker = node_picker.NodePicker(nodes, random.Random(0))
    return Site("r", Location("r", 0.0, 0.0), "", nodes, picker=picker)


def chat(tenant: str | None, prompt_tokens: int = 1500) -> Job:
    prefix = SYSTEM_PROMPT_TOKENS if tenant is not None else 0
    return Job(object(), prompt_tokens, 10, tenant, prefix)


def serve(node: Node, job: Job) -> None:
    """Runs `job` on `node` until it is decoding (its system prompt now cached there)."""
    node.submit(job, node.loop.now_s)
    node.loop.run(node.loop.now_s + 5.0)
    assert node.num_not_started == 0


def test_the_site_scores_with_the_pickers_own_function() -> None:
    assert node_picker.pick is region_picker.scoring.pick  # imported, not a copy


def test_the_node_holding_the_tenants_system_prompt_takes_its_next_chat() -> None:
    site = site_with_picker(3)
    holder = site.nodes[1]
    serve(holder, Job("earlier", 1500, 1000, "acme", SYSTEM_PROMPT_TOKENS))
    assert "acme" in holder.prefix_cache and holder.num_in_flight == 1
    now_s = holder.loop.now_s
    # Least request would pick an idle node; the picker sends it where 1,024 tokens are cached.
    for _ in range(10):  # whatever its random draws
        assert site.pick_node(DEFAULT_MODEL, chat("acme"), now_s) is holder
    # Another tenant's chat, cached nowhere, goes to an idle node.
    assert site.pick_node(DEFAULT_MODEL, chat("globex"), now_s) is not holder
    assert site.pick_node(DEFAULT_MODEL, chat(None), now_s) is not holder


def test_a_short_prompt_goes_to_a_busy_fast_node_not_an_idle_one_of_slow_steps() -> None:
    # Each candidate carries the step time its engine would measure now (its class, its
    # batch): a slow node's one step outweighs the fast node's running request.
    loop = EventLoop()
    slow = ServiceCalibration(prefill_tokens_per_s=800.0, step_base_s=0.4, step_per_seq_s=0.01)
    fast_node = Node("fast", "r", CAL, loop, lambda job: None, lambda job: None)
    slow_node = Node("slow", "r", slow, loop, lambda job: None, lambda job: None)
    nodes = [fast_node, slow_node]
    site = Site(
        "r",
        Location("r", 0.0, 0.0),
        "",
        nodes,
        picker=node_picker.NodePicker(nodes, random.Random(0)),
    )
    serve(fast_node, Job("earlier", 100, 1000, None, 0))
    assert fast_node.num_in_flight == 1
    for _ in range(10):
        assert site.pick_node(DEFAULT_MODEL, chat(None, prompt_tokens=32), loop.now_s) is fast_node


def test_the_picker_skips_a_node_that_is_down_and_names_none_when_all_are() -> None:
    site = site_with_picker(2)
    holder = site.nodes[0]
    serve(holder, Job("earlier", 1500, 1000, "acme", SYSTEM_PROMPT_TOKENS))
    holder.is_up = False
    now_s = holder.loop.now_s
    assert site.pick_node(DEFAULT_MODEL, chat("acme"), now_s) is site.nodes[1]
    site.nodes[1].is_up = False
    assert site.pick_node(DEFAULT_MODEL, chat("acme"), now_s) is None


@pytest.mark.slow  # two whole simulated runs
def test_the_picker_sends_a_request_back_when_the_gateways_alternative_is_sooner() -> None:
    site = site_with_picker(2)
    now_s = site.nodes[0].loop.now_s
    # Idle nodes at 1,000 prompt tokens/s: 1.5 s of prefill and a step for the first token.
    job = chat(None)
    assert site.pick_node(DEFAULT_MODEL, job, now_s, alternative_s=1.0) is node_picker.DEFLECTED
    assert site.pick_node(DEFAULT_MODEL, job, now_s, alternative_s=2.0) in site.nodes
    assert site.pick_node(DEFAULT_MODEL, job, now_s) in site.nodes


def test_on_mixed_hardware_meridians_retries_are_the_pickers_deflections() -> None:
    """No region fails there: with the pickers, requests their region's nodes would keep
    waiting go to the next-best region, and nothing is lost; without them, none goes back."""
    retried = {}
    for picker in (True, False):
        result = run_scenario(
            SCENARIOS["mixed_hardware"], 1, 1500, ServiceCalibration(), ["meridian"],
            options=WorldOptions(node_picker=picker),
        )  # fmt: skip
        stats = result.stats["meridian"]
        assert stats.lost == 0 and stats.failed == 0
        retried[picker] = stats.retried
    assert retried[True] > 0 == retried[False]


def test_prefix_heavy_with_the_picker_finds_more_cached_prompt_tokens_than_without() -> None:
    share = {}
    for picker in (True, False):
        result = run_scenario(
            SCENARIOS["prefix_heavy"], 0, 1500, CAL, ["meridian"],
            options=WorldOptions(node_picker=picker),
        )  # fmt: skip
        assert result.node_picker is picker
        stats = result.stats["meridian"]
        assert stats.lost == 0 and stats.failed == 0
        share[picker] = stats.cache_share
    assert share[True] > share[False] > 0.0
