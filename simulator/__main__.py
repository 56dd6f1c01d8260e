"""`python -m simulator run --scenario NAME|all --seed N --requests N [--json PATH] [--plots DIR]`
and `python -m simulator calibrate BENCH_JSON [--kv-blocks N]`.

Arguments → scenarios → a progress bar per policy → a table per scenario, then the JSON and the
plots if asked. A bad argument is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gateway.tiers import EdgeThresholds
from simulator.access import ACCESSES
from simulator.calibration import (
    CalibrationError,
    ServiceCalibration,
    from_bench_report,
    load_bench_report,
)
from simulator.compare import ScenarioResult, run_scenario
from simulator.edge import (
    DEFAULT_AUTO_SHARE,
    DEFAULT_MAX_CONCURRENCY,
    EDGE_CALIBRATION,
    EdgeSpec,
    default_edge_thresholds,
)
from simulator.gateway_timing import DEFAULT_MAX_RESUMES
from simulator.hardware import GPU_CLASS_CALIBRATION
from simulator.policies import POLICIES
from simulator.report import table
from simulator.run import WorldOptions
from simulator.scenarios import SCENARIOS
from wire.deflection import DEFAULT_DEFLECT_AT_WAITING
from wire.routing_policy import RoutingPolicy
from wire.validation import one_line


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative(text: str) -> int:
    value = _seed(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _policies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        what = ", ".join(map(repr, unknown)) or repr(text)
        raise argparse.ArgumentTypeError(f"unknown policy {what}; known: {', '.join(POLICIES)}")
    return names


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within 0-1, not {value}")
    return value


def _routing_policy(text: str) -> RoutingPolicy:
    try:
        return RoutingPolicy.model_validate_json(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(one_line(exc)) from None


def parser() -> OneLineParser:
    top = OneLineParser(prog="python -m simulator", description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    run = commands.add_parser("run", help="compare the policies on one scenario or all")
    run.add_argument("--scenario", required=True, choices=[*SCENARIOS, "all"], metavar="NAME")
    run.add_argument("--seed", type=_seed, default=0)
    run.add_argument("--requests", type=_positive, default=10_000)
    run.add_argument("--json", type=Path, help="write the results here")
    run.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    run.add_argument(
        "--calibration",
        type=Path,
        help=f"a calibration file (see `calibrate`), or {GPU_CLASS!r} (from published figures)",
    )
    run.add_argument("--policies", type=_policies, default=list(POLICIES), help="a,b,...")
    run.add_argument(
        "--routing",
        type=_routing_policy,
        help="the routing policy, as PUT /v1/routing takes it (default: its defaults)",
    )
    run.add_argument(
        "--access",
        choices=ACCESSES,
        default="anycast",
        help="how clients find their PoP: anycast (default) or dns (nearest stays on DNS)",
    )
    run.add_argument(
        "--deflect-at-waiting",
        type=_non_negative,
        default=DEFAULT_DEFLECT_AT_WAITING,
        help="the node agents' deflect_at_waiting (wire/deflection.py; 0: never deflect)",
    )
    run.add_argument(
        "--max-resumes",
        type=_non_negative,
        default=DEFAULT_MAX_RESUMES,
        help="the gateways' max_resumes (gateway/resume.py; 0: a broken stream ends in an error)",
    )
    run.add_argument(
        "--picker",
        choices=("on", "off"),
        default="on",
        help="each region's picker names the node (region_picker/scoring.py; off: least request)",
    )
    thresholds = default_edge_thresholds()
    edge = run.add_argument_group("edge tier (gateway/tiers.py; defaults: the gateway's)")
    edge.add_argument("--edge", action="store_true", help="an edge node beside every PoP")
    edge.add_argument(
        "--auto-share", type=_share, default=DEFAULT_AUTO_SHARE, help="of requests sent as auto"
    )
    edge.add_argument(
        "--edge-max-prompt-tokens", type=_positive, default=thresholds.max_prompt_tokens
    )
    edge.add_argument("--edge-max-tokens", type=_positive, default=thresholds.max_tokens)
    edge.add_argument("--edge-max-concurrency", type=_positive, default=DEFAULT_MAX_CONCURRENCY)
    edge.add_argument("--edge-calibration", type=Path, help="the edge node's calibration file")
    run.add_argument(
        "--jobs",
        type=_positive,
        default=os.cpu_count() or 1,
        help="worker processes, one world each (default: one per CPU)",
    )
    calibrate = commands.add_parser("calibrate", help="derive the node model from a benchmark")
    calibrate.add_argument("report", type=Path, help="python -m bench.engine_throughput --json")
    calibrate.add_argument("--kv-blocks", type=_positive, help="the benchmark's KV cache blocks")
    return top


GPU_CLASS = "gpu-class"  # --calibration's name for `GPU_CLASS_CALIBRATION`


def _load_calibration(path: Path | None) -> ServiceCalibration:
    if path is None:
        return ServiceCalibration()
    if str(path) == GPU_CLASS:
        return GPU_CLASS_CALIBRATION
    try:
        return ServiceCalibration.from_json(path.read_text())
    except OSError as exc:
        raise CalibrationError(f"cannot read {path}: {exc}") from exc


def _run_with_bars(
    name: str, args: argparse.Namespace, calibration: ServiceCalibration, console: Console
) -> ScenarioResult:
    with Progress(  # a bar per policy, gone once the table is printed
        TextColumn(f"{name:<14} {{task.description:<13}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        tasks = {p: bar.add_task(p, total=args.requests) for p in args.policies}

        def progress(policy: str, num_ended: int) -> None:
            bar.update(tasks[policy], completed=num_ended)

        return run_scenario(
            SCENARIOS[name],
            args.seed,
            args.requests,
            calibration,
            args.policies,
            progress,
            args.jobs,
            WorldOptions(
                args.routing or RoutingPolicy(),
                args.access,
                _edge_spec(args),
                args.deflect_at_waiting,
                args.max_resumes,
                args.picker == "on",
            ),
        )


def _edge_spec(args: argparse.Namespace) -> EdgeSpec | None:
    if not args.edge:
        return None
    calibration = EDGE_CALIBRATION
    if args.edge_calibration is not None:
        calibration = _load_calibration(args.edge_calibration)
    return EdgeSpec(
        auto_share=args.auto_share,
        thresholds=EdgeThresholds(args.edge_max_prompt_tokens, args.edge_max_tokens),
        max_concurrency=args.edge_max_concurrency,
        calibration=calibration,
    )


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.plots is not None and importlib.util.find_spec("matplotlib") is None:
        print("simulator: --plots needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    calibration = _load_calibration(args.calibration)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    results: list[ScenarioResult] = []
    for name in names:
        result = _run_with_bars(name, args, calibration, console)
        results.append(result)
        console.print(table(result))
        if args.plots is not None:
            from simulator import plots  # matplotlib is imported only when plots are asked for

            for path in plots.write_plots(result, args.plots):
                console.print(f"wrote {path}")
    if args.json is not None:
        documents = [r.to_json() for r in results]
        body = documents if args.scenario == "all" else documents[0]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(body, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # The real control plane's and gateway's warnings (breakers, shedding) would flood the table.
    logging.basicConfig(level=logging.ERROR)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 180)  # a table in a log file keeps its columns
    try:
        if args.command == "calibrate":
            report = load_bench_report(args.report)
            print(from_bench_report(report, args.kv_blocks).to_json())
            return 0
        return _run(args, console)
    except CalibrationError as exc:
        print(f"simulator: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
