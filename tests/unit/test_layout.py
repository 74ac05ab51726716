"""The layout shows the architecture: no import circles among engine/, sampling/, server/ and
mtpserve/ modules (lazy imports inside functions included), and engine/ never imports the
server or the command line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "sampling", "server", "mtpserve")


def import_graph() -> dict[str, set[str]]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target in files and target != name:
                    graph[name].add(target)
                    break
    return graph


def test_no_import_circles() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                circle = path[path.index(target) :] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_engine_never_imports_the_server_or_the_command_line() -> None:
    graph = import_graph()
    wrong = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("engine")
        for target in targets
        if target.startswith(("server", "mtpserve"))
    }
    assert not wrong


def test_no_private_name_is_imported_across_modules() -> None:
    """A name with a leading underscore is its module's own: another module that needs it needs
    a public name (a compiled extension module, named ``_x`` by convention, is a module)."""
    wrong = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or not node.module:
                    continue
                folder = ROOT.joinpath(*node.module.split("."))
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and not any(folder.glob(f"{alias.name}.*")):
                        wrong.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    assert not wrong, wrong


def test_the_loop_below_the_engine_never_calls_up_into_it() -> None:
    """Scheduling, cycles, caches and the model sit below ``engine.runtime``: they reach the
    engine only through the interfaces they declare (``RowEngine``, ``CostProbe``)."""
    graph = import_graph()
    lower = ("engine.scheduling", "engine.cycle", "engine.cache", "engine.model", "sampling")
    wrong = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith(lower)
        for target in targets
        if target in ("engine.runtime", "engine.distributed") or target.startswith("engine.bench")
    }
    assert not wrong
