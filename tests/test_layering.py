"""The parts of oomguard and the one way their imports run (docs/contributing/layout.md).

Every import of every module is read from the source with ``ast``: at module level, inside functions and under
``if TYPE_CHECKING:``, so a lazy import cannot hide a dependency. Pure Python, no module is imported.

:data:`MAY_IMPORT` is the rule, and the documentation's "Layout" page prints the same table (checked below). A new
module goes into the part it belongs to; a part that needs another part not in its row says so here first, and the
rows must still form no cycle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "oomguard"

# part -> the parts its modules may import (besides its own). "top" is oomguard/__init__.py (the public API, loaded
# lazily), cli.py and __main__.py.
MAY_IMPORT: dict[str, set[str]] = {
    "vocab": set(),
    "strategies": {"vocab"},
    "memory": {"vocab"},
    "oom": {"vocab", "strategies"},
    "decide": {"vocab", "strategies", "memory"},
    "display": {"vocab", "decide"},
    "run": {"vocab", "memory", "oom", "decide", "display"},
    "child": {"vocab", "memory", "oom"},
    "inprocess": {"vocab", "memory", "oom", "decide", "child"},
    "top": {"vocab", "memory", "oom", "decide", "display", "run", "inprocess"},
}
# The shared vocabulary: it imports none of the parts.
VOCABULARY = {"vocab", "strategies"}
# Libraries that start the training stack (a CUDA context, seconds of import): only the training-process side may
# import them, and the supervisor never reaches a module that does.
TORCH_SIDE = {"torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "deepspeed", "vllm", "datasets"}
TOP_MODULES = {"oomguard", "oomguard.cli", "oomguard.__main__"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (for `from X import name`: X.name when that is a module, else X)
    line: int
    where: str  # "module", "function" (inside a def or lambda) or "typing" (under `if TYPE_CHECKING:`)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def part_of(module: str) -> str:
    """``oomguard.run.supervisor`` -> ``run``; the top-level modules -> ``top``."""
    if module in TOP_MODULES:
        return "top"
    return module.split(".")[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path) -> Iterator[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def targets(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            return
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            base_name = ".".join(base + ([node.module] if node.module else []))
        else:
            base_name = node.module or ""
        for alias in node.names:
            full = f"{base_name}.{alias.name}"
            yield full if full in MODULES else base_name

    def walk(node: ast.AST, where: str) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    yield Import(module, target, child.lineno, where)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "typing" if where == "typing" else "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), where)
            else:
                yield from walk(child, where)

    yield from walk(ast.parse(path.read_text(encoding="utf-8"), str(path)), "module")


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports(module, path)]


def _ours(target: str) -> str | None:
    """The oomguard module an import target names (the longest known prefix), or None for another library."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in MODULES:
            return name
    return None


def _where(imp: Import) -> str:
    return f"{MODULES[imp.source].relative_to(ROOT)}:{imp.line} imports {imp.target}"


def _graph(kinds: set[str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        target = _ours(imp.target)
        if imp.where in kinds and target is not None and target != imp.source:
            graph[imp.source].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _reach(start: str, graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every module importing ``start`` imports, with one path to it. Importing a module runs its packages'
    ``__init__`` first, so a module also reaches its parents."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop()
        parent = v.rpartition(".")[0]
        for w in [*graph[v], *([parent] if parent else [])]:
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    return paths


# ---------------------------------------------------------------------------------------------------------------


def test_the_parts_are_what_ls_shows():
    """``ls oomguard/`` shows the parts: every module lives in one, and nothing else sits at the top."""
    assert {part_of(m) for m in MODULES} == set(MAY_IMPORT)
    top_level = {p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "__pycache__"))}
    assert top_level == {*(p for p in MAY_IMPORT if p != "top"), "__init__.py", "__main__.py", "cli.py", "py.typed"}
    for part in set(MAY_IMPORT) - {"top"}:
        doc = ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text(encoding="utf-8"))) or ""
        assert "May import" in doc, f"oomguard/{part}/__init__.py does not say what the part owns and may import"


def test_no_part_is_named_like_a_public_name():
    """Importing a submodule binds it to its package's attribute: a part named ``guard`` or ``estimate`` would
    replace the function ``oomguard.guard`` or ``oomguard.estimate`` once anything imported it."""
    init = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    public = next(ast.literal_eval(node.value) for node in init.body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__")
    children = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert not children & set(public)


def test_the_rules_form_no_cycle():
    assert not _cycles({p: set(deps) for p, deps in MAY_IMPORT.items()})
    assert all(not MAY_IMPORT[p] - VOCABULARY for p in VOCABULARY), "the vocabulary imports none of the parts"
    assert not MAY_IMPORT["memory"] & {"run", "inprocess", "display", "top"}
    assert "run" not in MAY_IMPORT["child"] and "child" not in MAY_IMPORT["run"]


def test_each_part_imports_only_what_it_may():
    wrong = []
    for imp in IMPORTS:
        target = _ours(imp.target)
        if target is None:
            continue
        if target == "oomguard" and imp.source not in TOP_MODULES:
            wrong.append(f"{_where(imp)}: the package root is the public API, not a dependency")
            continue
        a, b = part_of(imp.source), part_of(target)
        if a != b and b not in MAY_IMPORT[a]:
            wrong.append(f"{_where(imp)} ({imp.where} level): {a} may not import {b}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
    """No two modules import each other at module level (``TYPE_CHECKING`` imports count: they are the same
    knot), and no cycle runs through imports inside functions either."""
    for kinds in ({"module", "typing"}, {"module", "typing", "function"}):
        cycles = _cycles(_graph(kinds))
        assert not cycles, f"import cycles ({', '.join(sorted(kinds))} level): {cycles}"


def test_only_the_training_process_side_imports_torch():
    wrong = [_where(imp) for imp in IMPORTS
             if imp.target.split(".")[0] in TORCH_SIDE and part_of(imp.source) != "child"]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if part_of(m) == "run" or m in ("oomguard.cli",
                                                                                           "oomguard.__main__")))
def test_the_supervisor_never_reaches_torch(module):
    """Principle 1: the supervisor never imports torch. Nothing it imports, even inside a function, leads to the
    training-process side, the in-process guard or a library of the training stack."""
    graph = _graph({"module", "function"})
    reached = _reach(module, graph)
    bad = sorted((p for m, p in reached.items() if part_of(m) in ("child", "inprocess")), key=len)
    assert not bad, "\n".join(" -> ".join(p) for p in bad[:5])
    torch = [f"{' -> '.join(reached[imp.source])} -> {imp.target}" for imp in IMPORTS
             if imp.source in reached and imp.where != "typing" and imp.target.split(".")[0] in TORCH_SIDE]
    assert not torch, "\n".join(torch)


def test_the_layout_page_shows_the_same_rules():
    """The documentation's "Layout" page prints MAY_IMPORT as a table: one row per part, ``-`` for none."""
    text = (ROOT / "docs" / "contributing" / "layout.md").read_text(encoding="utf-8")
    block = text.split("<!-- layering: tests/test_layering.py MAY_IMPORT -->", 1)[1].split("```", 2)[1]
    rows = {}
    for line in block.strip().splitlines()[1:]:
        m = re.match(r"^(\w+)\s+(.*)$", line.strip())
        assert m, line
        rows[m.group(1)] = set() if m.group(2).strip() == "-" else {p.strip() for p in m.group(2).split(",")}
    assert rows == MAY_IMPORT


def _oomguard_base(package: str, node: ast.ImportFrom) -> str:
    """The module a ``from X import ...`` reads from, absolute (``oomguard.oom.parse.lines``)."""
    if node.level:
        return ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                        + ([node.module] if node.module else []))
    return node.module or ""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports() -> Iterator[str]:
    """``from X import _name`` where X is another oomguard module, in another package or the same one: a helper that
    two modules share is a public name of the module that owns it (or the two are one module). Counted with ``ast``
    over every import statement, as the 2026-11-29 review counted them: 24 statements pulling 85 private names
    before this rule (23 and 84 of them inside memory/estimate/ and oom/parse/), none after."""
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _oomguard_base(package, node)
            if not base.startswith("oomguard"):
                continue
            for alias in node.names:
                if _private(alias.name) and f"{base}.{alias.name}" != module:
                    yield f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {base}"


def _private_uses_in_tests() -> Iterator[str]:
    """What tests/ and bench/ take of oomguard's private names: ``from oomguard.x import _name``, and ``_name`` read
    off an oomguard module they imported (``preflight._stop(...)``). A test drives public names and behaviour, so a
    refactoring inside a module never breaks it. (Replacing a module's private seam with a fake through
    ``monkeypatch.setattr(module, "_nvml", ...)`` is not a read and stays allowed.) Before this rule: 8 names."""
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("oomguard")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oomguard") and not node.level:
                for alias in node.names:
                    if _private(alias.name):
                        yield f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {node.module}"
                    elif f"{node.module}.{alias.name}" in MODULES:
                        modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                yield f"{path.relative_to(ROOT)}:{node.lineno} reads {node.value.id}.{node.attr}"


def test_no_private_name_crosses_a_module():
    """A helper another module needs is public and named for what it does, in every part and within a package too
    (layout.md): no module imports another's underscored name."""
    found = list(_private_imports())
    assert found == [], f"{len(found)} private names imported from another module:\n" + "\n".join(found)


def test_tests_use_public_names():
    found = list(_private_uses_in_tests())
    assert found == [], f"{len(found)} private names used by tests or benchmarks:\n" + "\n".join(found)


def test_no_module_is_over_500_lines():
    """One concern per module: a module past 500 lines holds more than one (layout.md)."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert long == {}
