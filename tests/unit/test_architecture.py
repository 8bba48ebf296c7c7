"""docs/architecture.rst stays true: layered imports, no cycles, connections drained only through the view."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ztwisted"
#: modules that may enumerate a node's connections: the view, and the connections' owners
#: (xds owns its own gRPC connections to the control plane)
ENUMERATE = ("view", "hbone", "h2", "xds")
#: modules that may end connections: those, and the drain layer
DRAIN = ("view", "hbone", "h2", "xds", "drain")
#: tools sit above the runtime and may do anything
TOOLS = "tools"


def layers() -> list[tuple[str, list[str]]]:
    """The layer table of docs/architecture.rst, bottom first."""
    lines = (ROOT / "docs" / "architecture.rst").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["layer", "modules", "(under", "ztwisted/)"])
    table = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        name, *modules = line.split()
        table.append((name, modules))
    return table


def modules() -> dict[str, Path]:
    """Every module under ztwisted/, by dotted name relative to the package (``drain.controller``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


MODULES = modules()


def imports_of(path: Path) -> set[str]:
    """The ztwisted modules ``path`` imports, anywhere in it (function-level imports too, type-only ones not)."""
    imported = set()
    tree = ast.parse(path.read_text())
    # Imports only for type annotations (under ``if TYPE_CHECKING:``) never run: they make no dependency.
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name.startswith("ztwisted."):
                relative = name.removeprefix("ztwisted.")
                if relative in MODULES:
                    imported.add(relative)
    # "from ztwisted.inpod import wire" names both the package and the module: keep the module.
    return {name for name in imported if not any(other.startswith(name + ".") for other in imported)}


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def layer_of(module: str, table) -> int | None:
    best, rank = -1, None
    for index, (_, patterns) in enumerate(table):
        for pattern in patterns:
            if (module == pattern or module.startswith(pattern + ".")) and len(pattern) > best:
                best, rank = len(pattern), index
    return rank


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    return module.split(".")[0]


def test_the_layer_table_is_found_and_places_every_module():
    table = layers()
    assert [name for name, _ in table][:1] == ["base"] and table[-1][0] == TOOLS
    unplaced = sorted(module for module in MODULES if layer_of(module, table) is None)
    assert unplaced == [], "place these modules in the layer table of docs/architecture.rst"


def test_imports_run_downward_only():
    table = layers()
    upward = [
        f"{module} ({table[layer_of(module, table)][0]}) imports {imported} ({table[layer_of(imported, table)][0]})"
        for module, imported_modules in sorted(GRAPH.items())
        for imported in sorted(imported_modules)
        if layer_of(imported, table) > layer_of(module, table)
    ]
    assert upward == []


def test_no_module_import_cycle():
    assert cycles(GRAPH) == []


def test_no_package_import_cycle():
    packages: dict[str, set[str]] = {}
    for module, imported in GRAPH.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(i) for i in imported if package_of(i) != package_of(module)
        )
    assert cycles(packages) == []


def _allowed(module: str, owners: tuple[str, ...]) -> bool:
    return package_of(module) in owners or package_of(module) == TOOLS


def connection_uses(source: str) -> tuple[list[int], list[int]]:
    """Lines that enumerate connections (``.connections``, reading ``.app_connections``; asking
    the view ``app_connections()`` is fine) and that end them (``.drain(...)``, ``.abort_all()``,
    ``drain_all(...)``)."""
    tree = ast.parse(source)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    enumerating, ending = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (
            node.attr == "connections" or (node.attr == "app_connections" and id(node) not in called)
        ):
            enumerating.append(node.lineno)
        if isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if name in ("drain", "abort_all", "drain_all"):
                ending.append(node.lineno)
    return sorted(enumerating), sorted(ending)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_connections_are_enumerated_and_drained_only_through_the_view(module):
    enumerating, ending = connection_uses(MODULES[module].read_text())
    if not _allowed(module, ENUMERATE):
        assert enumerating == [], f"{module} enumerates connections (lines {enumerating}); use the node's view"
    if not _allowed(module, DRAIN):
        assert ending == [], f"{module} ends connections (lines {ending}); that is the drain layer's job"


UPWARD_AND_DRAINING = """
from ztwisted.tap import makeService

def close(node, view):
    for connection in node.listeners["uid"].hbone.connections:
        connection.drain(graceful=False)
    node.outbound.app_connections.abort_all()
    view.app_connections()
"""


def test_the_checks_can_fail():
    """The checkers see what they must: an upward import, a cycle, enumerating and draining."""
    table = layers()
    assert (
        layer_of("tap", table) > layer_of("node", table) > layer_of("hbone.pool", table) > layer_of("interfaces", table)
    )
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert connection_uses(UPWARD_AND_DRAINING) == ([5, 7], [6, 7])


MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60


def over_size() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith("_pb2.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > limit:
                    found.add(f"{path.relative_to(PACKAGE).as_posix()}:{node.name}")
    return found


def test_no_class_over_300_lines_and_no_function_over_60():
    assert over_size() == set(), "split these into named pieces (issue 12: one idea per function)"


def attributes_between_methods(source: str) -> list[str]:
    """Class attributes (assignments in a class body) that come after the class's first method:
    a reader looks for a class's fields and constants at its top."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        first_method = None
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first_method = first_method or item.name
            elif first_method and isinstance(item, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                found.append(f"{node.name} line {item.lineno} (after {first_method})")
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_class_attributes_between_methods(module):
    assert attributes_between_methods(MODULES[module].read_text()) == []


def test_the_attribute_check_can_fail():
    source = "class A:\n    x = 1\n\n    def f(self):\n        pass\n\n    y: int = 2\n"
    assert attributes_between_methods(source) == ["A line 7 (after f)"]
