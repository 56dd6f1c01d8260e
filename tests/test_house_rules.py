"""The layout rules of docs/architecture.md, read from the source with `ast`.

- No import runs back up: a module inside a subpackage may import from an enclosing package only
  what does not itself reach back down into that subpackage (floors import downwards).
- No import cycle between modules (lazy imports inside functions count too).
- No class with more than 15 public methods; no module over 400 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "engine",
    "node_agent",
    "control_plane",
    "gateway",
    "wire",
    "stack",
    "simulator",
    "region_picker",
)
MAX_PUBLIC_METHODS = 15
MAX_MODULE_LINES = 400


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: set[str] = field(default_factory=set)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def _modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = Module(name, path, is_package)
    for module in modules.values():
        module.imports = set(_imported(module, modules)) - {module.name}
    return modules


def _imported(module: Module, modules: dict[str, Module]) -> Iterator[str]:
    """The tree's modules that `module` imports, anywhere in its body."""
    for node in ast.walk(ast.parse(module.path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                yield target


def _reach(start: str, modules: dict[str, Module]) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in modules[todo.pop()].imports - seen:
            seen.add(target)
            todo.append(target)
    return seen


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return _modules()


def test_no_import_runs_back_up(modules: dict[str, Module]) -> None:
    back_up = []
    for module in modules.values():
        below = module.package
        for target in module.imports:
            above = modules[target].package
            if below.startswith(above + ".") and any(
                reached == below or reached.startswith(below + ".")
                for reached in _reach(target, modules)
            ):
                back_up.append(f"{module.name} -> {target}")
    assert back_up == []


def test_no_import_cycle(modules: dict[str, Module]) -> None:
    in_cycles = sorted(name for name in modules if name in _reach(name, modules))
    assert in_cycles == []


def test_no_class_over_fifteen_public_methods(modules: dict[str, Module]) -> None:
    too_wide = []
    for module in modules.values():
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, ast.ClassDef):
                public = [
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not item.name.startswith("_")
                ]
                if len(public) > MAX_PUBLIC_METHODS:
                    too_wide.append(f"{module.name}.{node.name}: {len(public)}")
    assert too_wide == []


def test_no_module_over_four_hundred_lines(modules: dict[str, Module]) -> None:
    too_long = [
        f"{module.name}: {lines}"
        for module in modules.values()
        if (lines := len(module.path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert too_long == []
