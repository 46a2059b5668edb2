"""The shape docs/architecture.md describes, checked on the source's syntax tree: no import
cycle between packages nor between modules (function-level imports included), no backend or
model transform named in the engine, the factory or the templates, the engine stays small, and
no module passes 500 lines without saying why."""
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
    """unit -> {imported unit: the importing modules}, every import statement counted but those
    under `if TYPE_CHECKING:` (they never run)."""
    modules = _modules()
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in _import_statements(tree):
            for target in _imported_modules(node, name, path.name == "__init__.py", modules):
                if _unit(target) not in (_unit(name), "rapidformer"):
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


# the backends and model transforms, by the words of their names; no module that must work
# for every one of them may name one (docs/architecture.md: "adding a model transform")
FEATURE_WORDS = {"peft", "lora", "qlora", "fp8", "float8", "liger", "unpad", "unpadded",
                 "packing", "packed", "zero", "zero1", "zero2", "zero3", "fsdp", "fsdp2",
                 "deepspeed", "megatron"}
# torch's own names that share a word with them
TORCH_NAMES = {"zero_grad", "zeros", "zeros_like", "new_zeros"}
# the engine, the factory, the templates (the loops and their metrics window)
FEATURE_BLIND = ["rapidformer/engine.py", "rapidformer/factory.py", "rapidformer/templates"]


def _feature_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every identifier, attribute, imported name or string (docstrings
    aside) whose words, split at '_', '.' and non-letters, name a backend or a transform."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.arg)):
            names = [getattr(node, "name", None) or node.arg]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            names = [node.value]
        for name in names:
            if name in TORCH_NAMES:
                continue
            words = {w.lower() for w in re.split(r"[^A-Za-z0-9]+|_", name) if w}
            if words & FEATURE_WORDS:
                found.append((getattr(node, "lineno", 0), name))
    return found


def test_the_engine_factory_and_templates_name_no_backend_or_transform():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
             for place in FEATURE_BLIND
             for path in sorted([PACKAGE.parent / place] if place.endswith(".py")
                                else (PACKAGE.parent / place).rglob("*.py"))
             for line, name in _feature_names(path.read_text())]
    assert found == [], "backend or transform names where none may be: " + "; ".join(found)


def test_the_feature_name_check_sees_names_not_prose():
    source = ('"""Docstrings may explain LoRA and megatron."""\n'
              "import rapidformer.transforms.lora as lora\n"
              "def f(cfg):\n"
              "    # a comment about fsdp is prose too\n"
              "    optimizer.zero_grad()\n"
              "    if cfg.trainer.unpad or cfg.model.arch.startswith('megatron'):\n"
              "        return deepspeed_config\n")
    assert sorted(name for _, name in _feature_names(source)) == \
        ["deepspeed_config", "lora", "megatron", "rapidformer.transforms.lora", "unpad"]


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


def test_the_longest_first_test_files_exist():
    # a renamed file would silently start last again (tests/conftest.py LONGEST_FIRST)
    from tests.conftest import LONGEST_FIRST

    here = Path(__file__).resolve().parent
    assert [name for name in LONGEST_FIRST if not (here / name).is_file()] == []
