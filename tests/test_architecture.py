"""The shape docs/architecture.md describes, checked on the source: no import cycle between
packages (function-level imports included), only the strategies and the validation table ask
which backend is on, and the engine stays small."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rapidformer"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _unit(module: str) -> str:
    """A subpackage (rapidformer.cli) or a top-level module (rapidformer.engine)."""
    return ".".join(module.split(".")[:2])


def _package_imports() -> dict[str, dict[str, set[str]]]:
    """unit -> {imported unit: the importing modules}, every import statement counted."""
    modules = _modules()
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for target in targets:
                if target in modules and _unit(target) not in (_unit(name), "rapidformer"):
                    graph[_unit(name)][_unit(target)].add(name)
    return graph


def _cycle(graph) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in list(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_packages():
    graph = _package_imports()
    cycle = _cycle(graph)
    detail = "" if cycle is None else "; ".join(
        f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a, b in zip(cycle, cycle[1:]))
    assert cycle is None, f"import cycle {' -> '.join(cycle)}: {detail}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b": set()}, "b": {"c": set()}, "c": {"a": set()}}) == \
        ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": set()}, "b": {}}) is None


def test_only_strategies_and_the_validation_table_ask_which_backend_is_on():
    asks = re.compile(r"memory\.name|is_megatron\(")
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}"
             for path in PACKAGE.rglob("*.py")
             if not path.is_relative_to(PACKAGE / "accelerators")
             and not path.is_relative_to(PACKAGE / "config")
             for number, line in enumerate(path.read_text().splitlines(), 1) if asks.search(line)]
    assert found == []


def test_the_engine_delegates_and_stays_small():
    source = (PACKAGE / "engine.py").read_text()
    assert len(source.splitlines()) <= 300
    assert "deepspeed" not in source.lower() and "fsdp" not in source.lower()
