"""The package's floors: a module imports only from its own subpackage or a lower floor, and no
imports go round in a circle. Lazy imports inside functions count: they run back up all the same."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpifl"

# Lowest floor first. A top-level module (units.py, ...) is its own unit; a subpackage is one unit.
FLOORS: list[tuple[str, ...]] = [
    ("units", "errors", "caches"),
    ("logs", "plugins", "metrics", "trackers"),
    ("config",),
    ("wire",),
    ("planning",),
    ("aggregation", "storage", "clock"),
    ("privacy", "learning"),
    ("algorithms",),
    ("roles",),
    ("api", "cli"),
    ("__main__",),
]
FLOOR_OF = {unit: level for level, units in enumerate(FLOORS, 1) for unit in units}  # 1: the lowest


def module_name(path: Path) -> str:
    """``mpifl/aggregation/kernels.py`` -> ``mpifl.aggregation.kernels`` (a package is its ``__init__``)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The floor unit of a module: its subpackage, or itself for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    """Every mpifl module ``path`` imports, anywhere in the file (``from mpifl.x import y`` names mpifl.x.y
    when y is a submodule, else mpifl.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mpifl":
            submodules = {f"{node.module}.{a.name}" for a in node.names} & set(MODULES)
            found.update(submodules)
            if len(submodules) < len(node.names):  # a name defined in the module itself, not a submodule
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "mpifl")
    return {m for m in found if m in MODULES and m != "mpifl"}


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_every_unit_of_the_package_is_on_a_floor():
    units = {unit_of(m) for m in MODULES} - {"__init__"}
    assert units <= set(FLOOR_OF), f"put these on a floor in tests/test_layering.py: {sorted(units - set(FLOOR_OF))}"


def test_no_import_runs_back_up_or_sideways():
    wrong = []
    for module, targets in GRAPH.items():
        here = unit_of(module)
        for target in targets:
            there = unit_of(target)
            if there != here and FLOOR_OF.get(there, -1) >= FLOOR_OF.get(here, len(FLOORS)):
                wrong.append(f"{module} (floor {FLOOR_OF.get(here)}) imports {target} (floor {FLOOR_OF.get(there)})")
    assert not wrong, "imports that run back up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_modules_import_each_other_in_a_circle():
    circles = [c for c in strongly_connected(GRAPH) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_the_architecture_page_lists_the_same_floors():
    """docs/explanation/architecture.md's table of floors says it is this list: it had lost `caches` and the
    `algorithms` floor, and numbered the floors above them one too low."""
    page = (PACKAGE.parent / "docs" / "explanation" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", page, re.MULTILINE)
    documented = {name.split(".")[0].rstrip("/"): int(floor) for floor, cell in rows
                  for name in re.findall(r"`([^`]+)`", cell)}
    assert documented == FLOOR_OF
