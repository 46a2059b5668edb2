"""The shape docs/architecture.md describes, checked on the source: no import cycle between
packages nor between modules (function-level imports included), only the strategies and the
validation table ask which backend is on, the engine stays small, and no module passes 500
lines without saying why."""
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


def _type_checking_only(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`: imports that never run."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(node: ast.AST):
    """Every import statement under a node, function-level ones included, except those under
    `if TYPE_CHECKING:` (its `else:` branch runs, so that one counts)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _type_checking_only(child.test):
            for branch in child.orelse:
                yield from _import_statements(ast.Module(body=[branch], type_ignores=[]))
        else:
            yield from _import_statements(child)


def _imported_modules(node: ast.Import | ast.ImportFrom, name: str, is_package: bool,
                      modules) -> list[str]:
    """The package modules one import statement of module `name` names: `from rapidformer.x
    import y` is rapidformer.x.y when that is a module, else rapidformer.x."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = node.module or ""
    if node.level:  # relative: counted from the module's package (a package's own __init__)
        anchor = name.split(".") if is_package else name.split(".")[:-1]
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    found = []
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            found.append(f"{base}.{alias.name}")
        elif base in modules:
            found.append(base)
    return found


def _module_imports(modules: dict[str, Path], root: Path = PACKAGE.parent
                    ) -> dict[str, dict[str, list[str]]]:
    """module -> {imported module: the import lines, "path:line: source"}. An import of one of
    the module's own parent packages is not an edge (Python has run them before the module),
    nor is a module's import of itself."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        for node in _import_statements(ast.parse(source)):
            for target in _imported_modules(node, name, path.name == "__init__.py", modules):
                if target == name or name.startswith(target + "."):
                    continue
                where = (f"{path.relative_to(root)}:{node.lineno}: "
                         f"{lines[node.lineno - 1].strip()}")
                if where not in graph[name][target]:
                    graph[name][target].append(where)
    return graph


def _cycles(graph) -> list[list[str]]:
    """One cycle, [a, b, ..., a], in each group of modules that import each other (each
    strongly connected component of more than one module), found by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle({a: {b: () for b in sorted(graph.get(a, {})) if b in component}
                    for a in sorted(component)})
            for component in sorted(components, key=sorted)]


def test_no_import_cycle_between_modules():
    graph = _module_imports(_modules())
    report = []
    for cycle in _cycles(graph):
        lines = "\n".join(f"    {line}" for a, b in zip(cycle, cycle[1:]) for line in graph[a][b])
        report.append(f"  {' -> '.join(cycle)}, imported at:\n{lines}")
    assert not report, "import cycles between modules:\n" + "\n".join(report)


def test_the_module_cycle_check_finds_a_planted_cycle(tmp_path):
    planted = {
        "pkg/__init__.py": "",
        "pkg/a.py": "import os\nfrom pkg import b\n",
        "pkg/b.py": "def f():\n    from pkg.sub import c\n    from . import a\n",
        "pkg/sub/__init__.py": "from pkg.sub import c\n",
        # a parent package, and an import that never runs: no edges back
        "pkg/sub/c.py": ("import pkg\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    import pkg.b\nelse:\n    from pkg.sub import d\n"),
        "pkg/sub/d.py": "",
    }
    modules = {}
    for relative, text in planted.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = list(Path(relative).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = _module_imports(modules, tmp_path)
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert graph["pkg.a"]["pkg.b"] == ["pkg/a.py:2: from pkg import b"]
    assert graph["pkg.b"]["pkg.a"] == ["pkg/b.py:3: from . import a"]
    assert dict(graph["pkg.sub.c"]) == {"pkg.sub.d": ["pkg/sub/c.py:6: from pkg.sub import d"]}
    assert _cycles({"a": {"b": ()}, "b": {"c": ()}, "c": {}}) == []


# a module may pass 500 lines only with a reason in its docstring, in a sentence that starts
# with these words (`grep -rn "Over 500 lines:" rapidformer/` lists them)
OVER_LIMIT_REASON = re.compile(r"(^|[.:]\s+|\n\s*)Over 500 lines: \S")


def _too_long(path: Path, limit: int = 500) -> int | None:
    """The module's line count when it is over the limit without a reason in its docstring."""
    source = path.read_text()
    count = len(source.splitlines())
    docstring = ast.get_docstring(ast.parse(source)) or ""
    return count if count > limit and not OVER_LIMIT_REASON.search(docstring) else None


def test_package_modules_stay_small():
    found = [f"{path.relative_to(PACKAGE.parent)}: {count} lines"
             for path in sorted(PACKAGE.rglob("*.py")) if (count := _too_long(path))]
    assert not found, ("over 500 lines, without a docstring sentence starting "
                       "\"Over 500 lines:\" that says why: " + "; ".join(found))


def test_the_size_check_reads_the_reason(tmp_path):
    body = "x = 1\n" * 501
    plain, reasoned, empty = (tmp_path / f"{n}.py" for n in ("plain", "reasoned", "empty"))
    plain.write_text('"""A module."""\n' + body)
    reasoned.write_text('"""A module.\n\nOver 500 lines: one table, read as a whole."""\n' + body)
    empty.write_text('"""A module. Over 500 lines:"""\n' + body)
    assert _too_long(plain) == 502 and _too_long(empty) == 502 and _too_long(reasoned) is None
    assert _too_long(plain, limit=502) is None
