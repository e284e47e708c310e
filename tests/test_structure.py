"""The codebase's shape, pinned: no import cycle, no private name imported across modules, the model layer below
everything, the product apart from the lab, no overlong function.

Every import counts, function-local ones included: a cycle held apart by an import inside a function is still a
cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "serving": "eyas.serving",
    "data": "eyas.data",
    "train": "eyas.train",
    "eval": "eyas.eval",
    "eyas": "eyas",
}
MAX_FUNCTION_LINES = 120


def _module_name(path: str) -> str:
    parts = path[: -len(".py")].split("/")
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    files = [f for f in out.stdout.split() if f.split("/")[0] in PACKAGES and "/vllm_plugins/" not in f]
    return {_module_name(f): REPO / f for f in files}


def _imports(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the eyas modules it imports, anywhere in its body; 'a imports _b from c' lines)."""
    graph: dict[str, set[str]] = defaultdict(set)
    private = []
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "eyas":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    dep = sub if sub in modules else node.module
                    if dep in modules and dep != mod:
                        graph[mod].add(dep)
                    if dep == node.module and alias.name.startswith("_") and dep != mod:
                        private.append(f"{mod} imports {alias.name} from {dep}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.name != mod:
                        graph[mod].add(alias.name)
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


@pytest.fixture(scope="module")
def imports():
    modules = _sources()
    return modules, *_imports(modules)


def test_the_cycle_finder_finds_a_cycle():
    graph = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles(defaultdict(set, {"a": {"b"}, "b": set()})) == []


def test_no_import_cycle_between_modules(imports):
    _, graph, _ = imports
    assert _cycles(graph) == []


def test_no_private_name_is_imported_across_modules(imports):
    _, _, private = imports
    assert private == []


def test_the_model_layer_imports_nothing_above_it(imports):
    _, graph, _ = imports
    above = {
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m.startswith("eyas.serving.models")
        for d in deps
        if not (d.startswith("eyas.serving.models") or d == "eyas.common")
    }
    assert above == set()


def test_the_product_imports_no_lab_module(imports):
    _, graph, _ = imports
    lab = {f"{m} imports {d}" for m, deps in graph.items() if not m.startswith("eyas.lab") for d in deps}
    assert {line for line in lab if " imports eyas.lab" in line} == set()


def test_no_function_is_over_the_limit(imports):
    modules, _, _ = imports
    long = []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []
