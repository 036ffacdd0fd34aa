"""Imports run downward: every import of kvmesh's source against the layer table in the README.

A unit is a folder or module right under `kvmesh` (`kvmesh.tiers`, `kvmesh.config`). A unit may import
its own modules and units of lower layers, never one of its own layer or above; within a unit, modules
import each other without a circle. Checked on the syntax tree, so lazy imports inside functions and
`TYPE_CHECKING` blocks count too: they are dependencies all the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kvmesh": "shared", "kvmesh.services": "services", "kvmesh.kernels": "kernels",
           "kvmesh.bench": "bench", "kvmesh.chaos": "chaos"}  # package-dir in pyproject.toml


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The kvmesh modules `name` imports (a name imported from a package counts as its module if it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {m for m in out if m in MODULES}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _layer_table() -> dict[str, int]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("<!-- layers: lowest first -->")[1].split("<!-- /layers -->")[0]
    layers = {}
    for row in re.finditer(r"^\| (\d+) \| (.+) \|$", table, re.M):
        for name in re.findall(r"`([\w.]+)`", row[2]):
            layers[f"kvmesh.{name}"] = int(row[1])
    return layers


def test_the_table_names_every_unit_once() -> None:
    layers = _layer_table()
    units = {unit(m) for m in MODULES} - {"kvmesh"}
    assert sorted(units - set(layers)) == [], "units missing from the README's layer table"
    assert sorted(set(layers) - units) == [], "the README's layer table names units that do not exist"


def test_no_import_runs_upward_or_sideways() -> None:
    layers = _layer_table()
    wrong = []
    for module, imported in sorted(GRAPH.items()):
        for target in sorted(imported):
            src, dst = unit(module), unit(target)
            if src != dst and src in layers and layers.get(dst, 0) >= layers[src]:
                wrong.append(f"{module} (layer {layers[src]}) -> {target} (layer {layers.get(dst)})")
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
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
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_module_imports_itself_through_others() -> None:
    # a package's __init__ importing its own modules is how packages re-export, not a circle
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
