"""LiteLLM's proxy as a baseline for `bench/gateway_overhead.py`, in a virtual environment of
its own (cached: `~/.cache/meridian-bench/litellm-venv`, or `$MERIDIAN_BENCH_CACHE/...`).

The first run makes the environment: `litellm` from the package registry, then the
requirements its `proxy` extra lists, read from the installed package's metadata, less the
ones the registry does not have (the extra pins `litellm-proxy` and its `-extras`; one that
will not install is skipped with a line), then whatever importing the proxy still reports
missing. pip's progress goes to stderr. Without the registry it answers None and says why:
the benchmark then runs without a LiteLLM column.

The proxy is run the way its production notes advise for speed: one Uvicorn worker, a master
key (it will not start without one) and no database (so no key lookups and no spend writes),
logs at ERROR, the bundled model
cost map (no fetch at start), `set_verbose` off; one model, `bench`, forwarded to the fake
upstream as an OpenAI-compatible backend (`openai/` with `api_base`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

CACHE = Path(os.environ.get("MERIDIAN_BENCH_CACHE", Path.home() / ".cache" / "meridian-bench"))
VENV = CACHE / "litellm-venv"
READY = VENV / ".meridian-ready"
MAX_ROUNDS = 10
UNAVAILABLE = ("litellm-proxy",)  # pinned by the extra, absent from the registry here

# Run in the environment: the proxy extra's requirements, markers evaluated, one per line.
_PROXY_REQUIREMENTS = """
from importlib.metadata import requires
from packaging.requirements import Requirement
for text in requires("litellm") or []:
    req = Requirement(text)
    if req.marker is not None and req.marker.evaluate({"extra": "proxy"}):
        req.marker = None
        print(req)
"""
_MISSING = re.compile(r"No module named '([A-Za-z0-9_]+)")
_NO_MATCH = re.compile(r"No matching distribution found for ([A-Za-z0-9_.-]+)")

# Without the registry pip would retry each download for minutes: fail fast instead.
_QUICK_FAIL = ("--retries", "1", "--timeout", "20")

Say = Callable[[str], None]


def _pip(python: Path, packages: list[str], say: Say) -> str | None:
    """pip install `packages`, its progress passed on to stderr line by line: None once
    installed, else the requirement the registry has no match for ("" if something else)."""
    args = [str(python), "-m", "pip", "install", "--progress-bar", "off", *_QUICK_FAIL, *packages]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    unmatched = ""
    for line in process.stdout:
        if line.startswith(("Collecting", "Installing", "Successfully", "ERROR")):
            say(line.rstrip())
        found = _NO_MATCH.search(line)
        if found is not None:
            unmatched = found.group(1)
    return None if process.wait() == 0 else unmatched


def _proxy_requirements(python: Path) -> list[str]:
    listed = subprocess.run(
        [str(python), "-c", _PROXY_REQUIREMENTS], capture_output=True, text=True, check=True
    ).stdout.split()
    return [r for r in listed if not r.startswith(UNAVAILABLE)]


def _missing_module(python: Path) -> str | None:
    """The module importing the proxy's server reports missing (None once it imports)."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    check = subprocess.run(
        [str(python), "-c", "import litellm.proxy.proxy_server"],
        capture_output=True,
        text=True,
        env=env,
    )
    if check.returncode == 0:
        return None
    found = _MISSING.search(check.stderr)
    if found is None:
        raise RuntimeError("the LiteLLM proxy does not import:\n" + check.stderr[-2000:])
    return found.group(1)


def ensure_venv(say: Say) -> Path | None:
    """The environment's python, made on first use; None (said why) where it cannot be."""
    python = VENV / "bin" / "python"
    if READY.exists():
        return python
    say(f"making LiteLLM's environment in {VENV} (once; later runs reuse it)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    if _pip(python, ["litellm"], say) is not None:
        say("no LiteLLM column: litellm did not install (no network to the package registry?)")
        return None
    requirements = _proxy_requirements(python)
    for _ in range(MAX_ROUNDS):  # dropping, one by one, what the registry has no match for
        unmatched = _pip(python, requirements, say)
        if unmatched is None:
            break
        kept = [r for r in requirements if not r.lower().startswith(unmatched.lower())]
        if not unmatched or kept == requirements:
            say("no LiteLLM column: the proxy's requirements did not install")
            return None
        say(f"skipped {unmatched}: the package registry has no match for it")
        requirements = kept
    for _ in range(MAX_ROUNDS):
        module = _missing_module(python)
        if module is None:
            READY.touch()
            return python
        say(f"the proxy reports {module} missing: installing it")
        if _pip(python, [module.replace("_", "-")], say) is not None:
            say(f"no LiteLLM column: {module} did not install")
            return None
    say("no LiteLLM column: the proxy still misses modules")
    return None


def proxy_command(python: Path, config_path: Path, port: int, upstream_url: str) -> list[str]:
    """The command running LiteLLM's proxy on `port` (its config written to `config_path`)."""
    config = {
        "model_list": [
            {
                "model_name": "bench",
                "litellm_params": {
                    "model": "openai/bench",
                    "api_base": upstream_url + "/v1",
                    "api_key": "bench",
                },
            }
        ],
        "litellm_settings": {"set_verbose": False, "drop_params": True},
    }
    config_path.write_text(json.dumps(config))  # YAML's superset: the proxy reads it as is
    litellm = python.parent / "litellm"
    return [str(litellm), "--config", str(config_path), "--host", "127.0.0.1"] + [
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]


def proxy_env(master_key: str) -> dict[str, str]:
    """The proxy's environment: `master_key` its one credential (it refuses to start without
    one), checked without a database."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MERIDIAN_", "LITELLM_"))}
    return base | {
        "LITELLM_MASTER_KEY": master_key,
        "LITELLM_LOG": "ERROR",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
