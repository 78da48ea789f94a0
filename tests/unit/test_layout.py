"""The architecture, as the imports show it: one way only, no cycles.

Adapters and tools → wiring → core: ``core`` (pure decisions) reads only the policy schema;
``policy`` (schema, loader, watcher) reads nothing of the rest; the store (``state``) and the
signal readers (``signals``) are adapters beside the servers; tools for people (``tools``:
explain, diff, top) are imported by the command line alone. Imports inside functions count;
only ``if TYPE_CHECKING:`` blocks are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "extproc"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, *, type_checking: bool = False) -> set[str]:
    """What module ``name`` imports (``type_checking``: with its ``if TYPE_CHECKING:`` imports)."""
    path = MODULES[name]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test) and not type_checking:
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def part(name: str) -> str:
    """The package-level part a module belongs to: ``extproc.core.queue`` → ``core``."""
    return name.split(".")[1] if "." in name else name


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(GRAPH) == []


def test_no_import_circle_even_for_the_type_checker() -> None:
    assert _cycles({name: imports_of(name, type_checking=True) for name in MODULES}) == []


def test_no_package_cycle() -> None:
    packages: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        packages.setdefault(part(name), set()).update(part(d) for d in deps if part(d) != part(name))
    assert _cycles(packages) == []


#: What each part may import besides itself (``extproc`` is the package's own ``__init__``). Every part
#: is listed: a new one must say where it stands.
ALLOWED = {
    "__main__": {"cli"},
    "api": set(),
    "policy": set(),
    "log": set(),
    "settings": set(),
    "core": {"policy"},
    "state": {"policy"},
    "metrics": {"core", "state"},
    "signals": {"core", "metrics", "policy"},
    "fleet": {"core", "metrics", "state"},
    "controller": {"core", "fleet", "metrics", "policy", "state"},
    "operations": {"api", "controller", "core", "policy", "signals"},
    "servers": {"api", "controller", "core", "log", "metrics", "operations", "policy", "state"},
    "app": {"controller", "metrics", "operations", "policy", "servers", "settings", "signals", "state"},
    "bootstrap": {"settings"},
    "localstack": {"bootstrap", "extproc", "settings"},
    "sim": {"core", "extproc", "localstack", "log", "policy", "settings"},
    "tools": {"api", "core", "policy", "settings", "sim"},
    "cli": {"app", "bootstrap", "extproc", "log", "policy", "settings", "sim", "tools"},
    "extproc": set(),
}

#: The core's parts only the core uses: everything else drives the one face, ``core/machine.py``.
CORE_INSIDE = frozenset({"extproc.core.admission", "extproc.core.edge", "extproc.core.budget",
                         "extproc.core.retry_budget", "extproc.core.queue", "extproc.core.drain",
                         "extproc.core.lanes", "extproc.core.timers"})


def test_every_part_is_in_the_table() -> None:
    assert sorted({part(name) for name in GRAPH} - set(ALLOWED)) == []


def test_only_the_core_reaches_past_the_machine() -> None:
    wrong = sorted(f"{name} imports {dep}" for name, deps in GRAPH.items() if part(name) != "core"
                   for dep in deps if dep in CORE_INSIDE)
    assert wrong == []


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package: str) -> None:
    wrong = sorted(f"{name} imports {dep}" for name, deps in GRAPH.items() if part(name) == package
                   for dep in deps if part(dep) != package and part(dep) not in ALLOWED[package])
    assert wrong == []


def test_only_the_command_line_uses_the_tools() -> None:
    users = sorted({part(name) for name, deps in GRAPH.items() if part(name) != "tools"
                    and any(part(d) == "tools" for d in deps)})
    assert users == ["cli"]


def test_the_checker_sees_imports_inside_functions() -> None:
    # app imports the store's implementations through state.store; cli imports tools lazily.
    assert "extproc.tools.top" in GRAPH["extproc.cli"]
    assert "extproc.state.store" in GRAPH["extproc.app"]


def test_the_package_is_typed() -> None:
    assert (PACKAGE / "py.typed").exists()


_METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "GaugeMetricFamily",
                 "CounterMetricFamily", "HistogramMetricFamily", "SummaryMetricFamily", "InfoMetricFamily"}


def test_every_metric_of_extproc_serve_is_declared_in_metrics_py() -> None:
    """Only extproc/metrics.py declares metrics; the simulated backend's vLLM-named ones are that
    program's own (extproc/sim)."""
    declared = []
    for name, path in MODULES.items():
        if name == "extproc.metrics" or part(name) == "sim":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else (
                    func.attr if isinstance(func, ast.Attribute) else "")
                if called in _METRIC_TYPES:
                    declared.append(f"{name}:{node.lineno} {called}")
    assert declared == []
    # The check sees declarations where they are.
    assert any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Counter"
               for n in ast.walk(ast.parse(MODULES["extproc.metrics"].read_text())))


#: Size as a symptom of a room doing several jobs: the most lines a class or a function may span in
#: extproc/ (the generated api/ and the argparse builder excepted).
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80
SIZE_EXEMPT = frozenset({"extproc.cli:build_parser"})


def _spans() -> list[tuple[str, str, int]]:
    """(kind, module:qualified name, lines) of every class and function outside extproc/api."""
    out: list[tuple[str, str, int]] = []
    for name, path in MODULES.items():
        if part(name) == "api":
            continue

        def walk(node: ast.AST, prefix: str, name: str = name) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    assert child.end_lineno is not None
                    out.append((kind, f"{name}:{prefix}{child.name}", child.end_lineno - child.lineno + 1))
                    walk(child, f"{prefix}{child.name}.")
                else:
                    walk(child, prefix)

        walk(ast.parse(path.read_text()), "")
    return out


def test_no_class_or_function_outgrows_one_job() -> None:
    spans = _spans()
    too_big = sorted(f"{what} {lines} lines" for kind, what, lines in spans if what not in SIZE_EXEMPT
                     and lines > (MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES))
    assert too_big == []
    # The measure sees what it measures: the largest class is sizeable, and the exemption exists.
    assert max(lines for kind, _, lines in spans if kind == "class") > MAX_CLASS_LINES // 2
    assert any(what in SIZE_EXEMPT for _, what, _ in spans)
