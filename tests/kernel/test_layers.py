"""The parts stay apart as DESIGN.md draws them, and no module imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGES = ("ortune", "api", "worker", "trainer_core", "serve")
# what each part may import of the others
ALLOWED = {
    "ortune": {"ortune", "trainer_core"},  # the kernel reads trainer_core's torch-free spec
    "api": {"api", "ortune", "trainer_core"},
    "worker": {"worker", "ortune", "trainer_core"},
    "trainer_core": {"trainer_core"},
    "serve": {"serve", "ortune", "trainer_core"},  # inference: the kernel's storage, the chat template
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each module of ours and the modules of ours it imports (at any depth of the file)."""
    modules = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_each_part_imports_only_what_it_may() -> None:
    for module, targets in _imports().items():
        part = module.split(".")[0]
        for target in targets:
            assert target.split(".")[0] in ALLOWED[part], f"{module} imports {target}"


def test_no_import_cycle() -> None:
    graph = _imports()
    # a package's __init__ re-exporting its own modules is not a cycle through them
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_no_module_is_over_400_lines() -> None:
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            assert lines <= 400, f"{path.relative_to(ROOT)} has {lines} lines"
