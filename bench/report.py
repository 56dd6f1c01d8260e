"""What the engine benchmarks' reports share: the machine they ran on (the CPU's AVX-512 and AMX
flags, the load average before and after, which every figure depends on), and the report's way
out (a JSON line of its summary printed, the whole written where asked)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def cpu_vector_flags() -> list[str]:
    """The CPU's AVX-512 and AMX flags: which kernels torch and ours can use here."""
    try:
        words = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return sorted({w for w in words if w.startswith(("avx512", "amx"))})


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine(load_before: list[float]) -> dict[str, Any]:
    """A report's machine part: the load average at the start (`load_before`) and now, the
    CPU's vector flags."""
    return {"load_average": [load_before, load_average()], "cpu_flags": cpu_vector_flags()}


def report_out(report: dict[str, Any], path: str | None, summary_keys: Sequence[str]) -> None:
    """Print the report's `summary_keys` as one JSON line; write the whole report to `path`."""
    print(json.dumps({k: report.get(k) for k in summary_keys}))
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
