"""A region's ingress: least requests in flight, and the node agents' deflection
(wire/deflection.py) as the region's Envoy retries it."""

from __future__ import annotations

from simulator.calibration import ServiceCalibration
from simulator.events import EventLoop
from simulator.models import DEFAULT_MODEL
from simulator.node import Job, Node
from simulator.site import Site
from wire.geo import Location

CAL = ServiceCalibration(prefill_tokens_per_s=1000.0, step_base_s=0.05, step_per_seq_s=0.01)


def site_of(num_nodes: int, deflect_at_waiting: int) -> Site:
    loop = EventLoop()
    nodes = [Node(f"n{i}", "r", CAL, loop, lambda job: None, lambda job: None) for i in range(3)]
    return Site("r", Location("r", 0.0, 0.0), "", nodes[:num_nodes], True, deflect_at_waiting)


def pick(site: Site) -> Node | None:
    """The node the ingress sends a short request without a system prompt to, now."""
    return site.pick_node(DEFAULT_MODEL, Job("new", 100, 10, None, 0), site.nodes[0].loop.now_s)


def decoding_node(site: Site, index: int, num_requests: int) -> Node:
    """Node `index` with `num_requests` past their first token (decoding, nothing waiting)."""
    node = site.nodes[index]
    for i in range(num_requests):
        node.submit(Job(f"{node.name}/{i}", 1, 1000, None, 0), 0.0)
        node.loop.run(node.loop.now_s + 1.0)
    assert node.num_in_flight == num_requests and node.num_not_started == 0
    return node


def test_the_ingress_picks_the_node_with_the_fewest_requests_in_flight() -> None:
    site = site_of(3, deflect_at_waiting=1)
    decoding_node(site, 0, 3), decoding_node(site, 2, 1)
    busy = decoding_node(site, 1, 2)
    assert pick(site) is site.nodes[2]
    site.nodes[2].is_up = False
    assert pick(site) is busy and site.num_deflected == 0


def test_a_node_with_a_request_still_waiting_deflects_to_the_next_least_loaded() -> None:
    site = site_of(3, deflect_at_waiting=1)
    decoding_node(site, 0, 4), decoding_node(site, 1, 3)
    fresh = site.nodes[2]
    fresh.submit(Job("long prompt", 2000, 10, None, 0), fresh.loop.now_s)  # 2 s of prefill
    assert fresh.num_in_flight == 1 and fresh.num_not_started == 1
    assert pick(site) is site.nodes[1]  # 3 in flight, but none of them waits
    assert site.num_deflected == 1
    # Off (0), least-request alone sends it behind the long prefill.
    site.deflect_at_waiting = 0
    assert pick(site) is fresh


def test_only_the_first_attempt_is_deflected_and_a_lone_node_takes_it() -> None:
    site = site_of(3, deflect_at_waiting=1)
    for node in site.nodes:
        node.submit(Job(node.name, 2000, 10, None, 0), 0.0)
    # All wait: n0 deflects attempt 1, Envoy's attempt 2 goes to n1 and is taken.
    assert pick(site) is site.nodes[1] and site.num_deflected == 1
    lone = site_of(1, deflect_at_waiting=1)
    lone.nodes[0].submit(Job("a", 2000, 10, None, 0), 0.0)
    # No other host: the retry lands on it again.
    assert pick(lone) is lone.nodes[0]
    assert lone.num_deflected == 1


def test_a_deep_queue_does_not_deflect_its_neighbours_are_as_busy() -> None:
    site = site_of(2, deflect_at_waiting=1)
    for node in site.nodes:
        for i in range(3):  # three waiting each: past 1 + DEFLECT_WINDOW
            node.submit(Job(f"{node.name}/{i}", 2000, 10, None, 0), 0.0)
    assert pick(site) is site.nodes[0] and site.num_deflected == 0
