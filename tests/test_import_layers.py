"""The import contract of docs/architecture.md: no circle, and imports point down the layers.

Every import statement counts: module level, inside functions, and under ``TYPE_CHECKING`` (a
lazy or typing-only import is still a dependency). The graph is read from the source with
``ast``, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the layers of ``gradian``, by the first name under ``gradian.`` (docs/architecture.md);
#: a module may import its own layer and the ones below, never one above
LAYERS: dict[str, int] = {
    # 1. ground: plain data and the things every stage raises or writes
    "": 1, "errors": 1, "findings": 1, "paths": 1, "config": 1, "atomic": 1, "redact": 1, "termination": 1,
    "sizes": 1, "chunks": 1, "jsontypes": 1,
    # 2. data and runs
    "data": 2, "runs": 2, "model_loading": 2, "distributed": 2, "inputs": 2, "transformers_compat": 2,
    # 3. gradients and their store
    "grads": 3, "index": 3,
    # 4. math over gradients and factors handed in
    "engines": 4,
    # 5. lanes
    "audit": 5, "evaluate": 5, "query": 5, "cluster": 5, "explain": 5, "counterfactual": 5, "report": 5,
    "plan": 5, "train": 5, "tinyworld": 5, "doctor": 5, "replay": 5,
    # 6. orchestration
    "attribution": 6, "cli": 6, "__main__": 6,
}
#: what engines may not reach even though it lies below them: engines are math over what the
#: attribution lane hands them, and never load a model, build an index or install a hook
ENGINES_MAY_NOT_IMPORT = ("grads", "index", "model_loading", "data", "distributed")
#: the packages above the core, in order: each may import the ones before it, never after
TOP = ("gradian", "gradian_mlflow", "projects", "tests")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for the core, the MLflow integration and the projects."""
    found: dict[str, Path] = {}
    for base, package in ((ROOT / "core", "gradian"), (ROOT, "gradian_mlflow"), (ROOT, "projects")):
        for path in (base / package).rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}`` over every import statement of each file."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                # ``from a.b import c``: the module c when it is one, else a.b itself
                targets = [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target.split(".")[0] in TOP:
                    resolved = target if target.split(".")[0] == "tests" else _resolve(target, modules)
                    if resolved and resolved != name:
                        edges.setdefault(resolved, node.lineno)
        graph[name] = edges
    return graph


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, {})))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


GRAPH = _imports(_modules())


def test_every_stage_of_the_core_has_a_layer():
    stages = {_stage(m) for m in GRAPH if m.split(".")[0] == "gradian"}
    assert stages <= set(LAYERS), f"give these stages a layer in LAYERS and docs/architecture.md: {sorted(stages - set(LAYERS))}"


def test_no_import_circle():
    assert _cycles(GRAPH) == []


def test_imports_point_down_the_layers():
    upward = [f"{m}:{line} imports {t} ({_stage(m) or 'gradian'} is layer {LAYERS[_stage(m)]}, "
              f"{_stage(t)} layer {LAYERS[_stage(t)]})"
              for m, edges in GRAPH.items() if m.split(".")[0] == "gradian"
              for t, line in edges.items() if t.split(".")[0] == "gradian" and LAYERS[_stage(t)] > LAYERS[_stage(m)]]
    assert upward == []


def test_engines_reach_no_model_index_or_hooks():
    reached = [f"{m}:{line} imports {t}" for m, edges in GRAPH.items() if _stage(m) == "engines"
               for t, line in edges.items() if _stage(t) in ENGINES_MAY_NOT_IMPORT]
    assert reached == []


def test_packages_import_only_those_below_them():
    wrong = [f"{m}:{line} imports {t}" for m, edges in GRAPH.items() for t, line in edges.items()
             if TOP.index(t.split(".")[0]) > TOP.index(m.split(".")[0])]
    assert wrong == []


def test_the_contract_sees_a_function_local_and_a_typing_import(tmp_path):
    """The reader counts imports inside functions and under TYPE_CHECKING (a planted circle)."""
    (tmp_path / "gradian").mkdir()
    (tmp_path / "gradian" / "a.py").write_text("def f():\n    from gradian import b\n")
    (tmp_path / "gradian" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gradian.a\n")
    modules = {"gradian.a": tmp_path / "gradian" / "a.py", "gradian.b": tmp_path / "gradian" / "b.py"}
    assert _cycles(_imports(modules)) == [["gradian.a", "gradian.b"]]
