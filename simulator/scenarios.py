"""The scenarios: one fleet, one kind of day, and what goes wrong in it.

Every scenario runs the same fleet (`NODES_PER_REGION`, serving the default model), plus, where a
scenario places a second model, that model's nodes (simulator/models.py), at a mean load of
`utilisation` of its estimated capacity; a simulated day lasts as long as the run, so every
continent passes through its peak (1.5x its mean) once. Times of events are fractions of the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from simulator.calibration import ServiceCalibration
from simulator.hardware import NODE_CLASSES
from simulator.models import DEFAULT_MODEL, PlacedModel, Placement
from simulator.workload import Surge, WorkloadSpec

NODES_PER_REGION: Final[Mapping[str, int]] = {
    "us-east": 5, "us-west": 4, "eu-west": 4, "eu-central": 4, "ap-southeast": 4,
    "ap-northeast": 5, "sa-east": 3,
}  # fmt: skip

# Nodes beat and summaries flow this long before the first request (late beats: longer).
WARMUP_S: Final = 5.0
# The batch a loaded node runs at, for the capacity estimate.
TYPICAL_BATCH: Final = 32


@dataclass(frozen=True, slots=True)
class Outage:
    name: str  # a region (region_failure, region_hang), a node (node_hang) or a PoP
    start: float  # fraction of the run
    end: float


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    utilisation: float = 0.55
    surge: tuple[str, float, float, float] | None = None  # continent, start, end, factor
    region_failures: tuple[Outage, ...] = ()  # their nodes die: their connections reset
    region_hang: Outage | None = None  # its nodes hang: connections stay open, beats stop
    node_hang: Outage | None = None  # one node hangs; the others of its region serve on
    pop_withdrawal: Outage | None = None
    extra_beat_delay_s: float = 0.0
    workload: WorkloadSpec | None = None  # overrides of lengths and tenants (rate is derived)
    placed: PlacedModel | None = None  # a second model, in a few regions only
    # Region → its default-model nodes' classes (`calibration.NODE_CLASSES`) and how many of
    # each; a region not named here (and every placed model's node) is of the world's class.
    node_classes: Mapping[str, tuple[tuple[str, int], ...]] | None = None

    @property
    def placement(self) -> Placement:
        return Placement.of(NODES_PER_REGION, self.placed)

    def calibrations(self, base: ServiceCalibration) -> dict[str, list[ServiceCalibration]]:
        """Each region's nodes' calibrations, in the order of `placement.nodes`: `base` scaled
        by each node's class."""
        result: dict[str, list[ServiceCalibration]] = {}
        for region, models in self.placement.nodes.items():
            classes = (self.node_classes or {}).get(region, ())
            scaled = [NODE_CLASSES[name].of(base) for name, count in classes for _ in range(count)]
            result[region] = scaled + [base] * (len(models) - len(scaled))
        return result


# The per-model scenarios' second model: the default model's weights in fp32, as the stack's
# default fleet serves it, on nodes of its own in two of the seven regions.
PLACED_MODEL: Final = "smollm2-135m-instruct-fp32"
PLACED_NODES: Final[Mapping[str, int]] = {"us-east": 3, "eu-west": 3}
PLACED_SHARE: Final = 0.1
# One region of the placed model's dies, then the other, the only one left, so that for 15% of
# the run no region serves it; then they come back in the same order.
PLACED_REGION_FAILURES: Final = (Outage("us-east", 0.3, 0.6), Outage("eu-west", 0.45, 0.75))

# Regions of two or three node classes (the default model's nodes, as many as elsewhere): one
# region of the fastest class alone, one of the slowest alone, the rest mixed.
MIXED_NODE_CLASSES: Final[Mapping[str, tuple[tuple[str, int], ...]]] = {
    "us-east": (("h100", 3), ("a100", 2)),
    "us-west": (("l40s", 4),),
    "eu-west": (("h100", 2), ("l40s", 2)),
    "eu-central": (("a100", 2), ("l40s", 2)),
    "ap-southeast": (("h100", 1), ("a100", 2), ("l40s", 1)),
    "ap-northeast": (("h100", 5),),
    "sa-east": (("a100", 1), ("l40s", 2)),
}  # fmt: skip

PREFIX_HEAVY = WorkloadSpec(
    num_requests=0,
    rate_req_s=0.0,
    day_s=0.0,
    user_prompt_tokens=(32, 256),
    num_tenants=32,
    share_with_system_prompt=0.9,
    system_prompt_tokens=(1024, 3072),
)

SCENARIOS: Final[Mapping[str, Scenario]] = {
    s.name: s
    for s in (
        Scenario("steady", "a normal day"),
        Scenario("surge", "Asia at 3x from 40% to 60% of the run", surge=("asia", 0.4, 0.6, 3.0)),
        Scenario(
            "region_failure",
            "ap-northeast dies at 30% of the run and returns at 60%",
            region_failures=(Outage("ap-northeast", 0.3, 0.6),),
        ),
        Scenario(
            "region_hang",
            "ap-northeast hangs (connections open, silent) at 30% of the run, returns at 60%",
            region_hang=Outage("ap-northeast", 0.3, 0.6),
        ),
        Scenario(
            "node_hang",
            "one of ap-northeast's nodes hangs at 30% of the run, returns at 60%",
            node_hang=Outage("ap-northeast-0", 0.3, 0.6),
        ),
        Scenario(
            "pop_withdrawal",
            "the Tokyo PoP leaves Anycast from 30% to 70% of the run",
            pop_withdrawal=Outage("tokyo", 0.3, 0.7),
        ),
        Scenario(
            "stale", "capacity reports reach the control plane 5 s late", extra_beat_delay_s=5.0
        ),
        Scenario(
            "prefix_heavy",
            "90% of tenants send a 1-3k token system prompt",
            workload=PREFIX_HEAVY,
        ),
        Scenario(
            "mixed_hardware",
            "regions of two or three node classes (h100-, a100-, l40s-class speeds)",
            node_classes=MIXED_NODE_CLASSES,
        ),
        *(
            Scenario(
                f"model_{variant}",
                f"{PLACED_MODEL} ({PLACED_SHARE:.0%} of requests) is served in us-east and "
                f"eu-west only; us-east dies at 30% of the run, eu-west at 45%, us-east returns "
                f"at 60%, eu-west at 75%; with no region left its requests {what}",
                region_failures=PLACED_REGION_FAILURES,
                placed=PlacedModel(PLACED_MODEL, PLACED_NODES, PLACED_SHARE, fallbacks),
            )
            for variant, what, fallbacks in (
                ("fallback", f"go to its fallback, {DEFAULT_MODEL}", (DEFAULT_MODEL,)),
                ("error", "fail (no fallback)", ()),
            )
        ),
    )
}


def node_capacity_req_s(calibration: ServiceCalibration, spec: WorkloadSpec) -> float:
    """Requests per second one node sustains at a typical batch, prefix hits not counted."""
    mean_prompt = sum(spec.user_prompt_tokens) / 2 + spec.share_with_system_prompt * (
        sum(spec.system_prompt_tokens) / 2
    )
    mean_output = sum(spec.output_tokens) / 2
    prefill_s = mean_prompt / calibration.prefill_tokens_per_s
    decode_s = mean_output * calibration.step_s(TYPICAL_BATCH) / TYPICAL_BATCH
    return 1.0 / (prefill_s + decode_s)


def workload_of(
    scenario: Scenario, num_requests: int, calibration: ServiceCalibration
) -> WorkloadSpec:
    base = scenario.workload or WorkloadSpec(num_requests=0, rate_req_s=0.0, day_s=0.0)
    placement = scenario.placement
    capacity_req_s = sum(
        node_capacity_req_s(node, base)
        for nodes in scenario.calibrations(calibration).values()
        for node in nodes
    )
    rate_req_s = scenario.utilisation * capacity_req_s
    duration_s = num_requests / rate_req_s
    start_s = WARMUP_S + scenario.extra_beat_delay_s
    surge = None
    if scenario.surge is not None:
        continent, start, end, factor = scenario.surge
        surge = Surge(continent, start_s + start * duration_s, start_s + end * duration_s, factor)
    return dataclasses.replace(
        base,
        num_requests=num_requests,
        rate_req_s=rate_req_s,
        day_s=duration_s,
        surge=surge,
        start_s=start_s,
        models=placement.shares,
    )
