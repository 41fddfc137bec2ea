"""The library's import graph: no cycles, and no import of the benchmarks package.

Every ``import`` statement counts, module level or inside a function (a function-level import
that closes a cycle is still a cycle; it only hides it until call time), and so does every
``importlib.import_module("...")`` of a constant name, except those under ``if TYPE_CHECKING:``.
``kernels/`` is installed as ``harts.kernels``. The library may not even name the benchmarks
package in a string (an entry point or a lazy import would reach it unseen).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

from tests.helpers import REPO

PACKAGES = {"harts": REPO / "harts", "harts.kernels": REPO / "kernels"}


def module_files() -> dict[str, Path]:
    modules = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = path
    return modules


def imported_names(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(inner) for inner in ast.walk(node))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
        elif _is_import_module_call(node):
            names.append(node.args[0].value)
    return names


def _is_import_module_call(node: ast.AST) -> bool:
    """``importlib.import_module("name")`` or ``import_module("name")`` with a constant module name."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return False
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    return name == "import_module"


def _docstrings(tree: ast.AST) -> set[int]:
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, documented) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def benchmark_mentions(path: Path) -> list[str]:
    """String constants of a module, docstrings aside, that name a benchmarks module (dotted, as an entry point or a path)."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and any(part in node.value for part in ("harts_bench.", "harts_bench:", "benchmarks/harts_bench"))]


def import_graph() -> nx.DiGraph:
    modules = module_files()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for name in imported_names(module, path):
            target = name
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # importing one's own package (its __init__) is how Python loads a submodule, not a cycle
            if target and target != module and not module.startswith(target + "."):
                graph.add_edge(module, target)
    return graph


def test_the_import_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert graph.has_edge("harts.train.loop", "harts.rollouts.inputs")  # imported inside run_training
    assert graph.has_edge("harts.kernels.dispatch", "harts.kernels.conv.fla")  # imported inside a method


def test_the_import_graph_sees_import_module_calls_and_benchmark_names(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text('"""Docs may name harts_bench.runtime."""\nimport importlib\n\ndef load():\n'
                      "    return importlib.import_module('harts.train.demo')\n\nENTRY = 'harts_bench.runtime:main'\n")
    assert "harts.train.demo" in imported_names("harts.probe", module)
    assert benchmark_mentions(module) == ["harts_bench.runtime:main"]


def test_the_library_has_no_import_cycles():
    cycles = sorted(nx.simple_cycles(import_graph()), key=len)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle + cycle[:1]) for cycle in cycles[:10])


def test_the_library_never_imports_the_benchmarks():
    offenders = [
        f"{module} imports {name}"
        for module, path in module_files().items()
        for name in imported_names(module, path)
        if name.split(".")[0] in ("harts_bench", "benchmarks")
    ]
    assert not offenders


def test_the_library_names_no_benchmark_module():
    offenders = [f"{module}: {text!r}" for module, path in module_files().items() for text in benchmark_mentions(path)]
    assert not offenders
