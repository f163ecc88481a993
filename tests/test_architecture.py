"""The package layout's rules, checked on the source: no import cycle among the modules
of ``pipeline/`` and ``tasks/`` (imports inside functions and under ``if TYPE_CHECKING:``
count too: a cycle for the type checker is a cycle for the reader), ``tasks/`` never
imports Dask, no module over 500 lines, no function over 80, and the wheel's package list
covers every package directory.

Imports are read with ``ast``. ``from pkg import name`` is an edge to ``pkg.name`` when
that is a module, else to ``pkg``: importing a sibling submodule is not an edge to the
package ``__init__`` being loaded.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "tasks")


def module_files() -> dict[str, Path]:
    """``dotted module name -> file`` for every module of the product packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _walk_runtime(node: ast.AST):
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for sub in child.orelse:
                yield sub
                yield from _walk_runtime(sub)
            continue
        yield child
        yield from _walk_runtime(child)


def imported_names(name: str, path: Path, type_checking: bool = True) -> set[str]:
    """Absolute dotted names imported by module ``name`` (with ``type_checking``, those
    under ``if TYPE_CHECKING:`` too)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (ast.walk(tree) if type_checking else _walk_runtime(tree)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.update(f"{mod}.{a.name}" for a in node.names)
            out.add(mod)
    return out


def import_graph() -> dict[str, set[str]]:
    """``module -> the product modules it imports`` (most specific existing module)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for imp in imported_names(name, path):
            if imp in files:
                edges.add(imp)
        # "from pkg import sub" adds both pkg and pkg.sub: keep only the submodule.
        edges -= {e for e in edges if any(o.startswith(e + ".") for o in edges)}
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (iterative DFS)."""
    color: dict[str, int] = {}
    for start in sorted(graph):
        if color.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        color[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = 2
                stack.pop()
                path.pop()
            elif color.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not color.get(nxt):
                color[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_function_level_and_type_checking_cycles(tmp_path):
    # The checker itself: a cycle through an import inside a function is found, and so
    # is one behind TYPE_CHECKING (unless asked for runtime imports only).
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from b import x\n")
    b = tmp_path / "b.py"
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import c\nimport a\n")
    c = tmp_path / "c.py"
    c.write_text("import b\n")
    files = (("a", a), ("b", b), ("c", c))
    graph = {m: {i for i in imported_names(m, p) if i in ("a", "b", "c")} for m, p in files}
    assert find_cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])
    graph["b"].discard("a")
    assert find_cycle(graph) in (["b", "c", "b"], ["c", "b", "c"]), "the TYPE_CHECKING import is an edge"
    runtime = {m: {i for i in imported_names(m, p, type_checking=False) if i in ("a", "b", "c")} for m, p in files}
    runtime["b"].discard("a")
    assert find_cycle(runtime) is None


def test_tasks_never_imports_dask():
    files = module_files()
    bad = {
        name: sorted(i for i in imported_names(name, path) if i.split(".")[0] in ("dask", "distributed", "pipeline"))
        for name, path in files.items()
        if name.startswith("tasks")
    }
    assert not {k: v for k, v in bad.items() if v}


def test_every_package_directory_is_a_package():
    # setuptools' find only ships directories with an __init__.py: a folder without one
    # would be silently missing from the wheel.
    missing = [
        str(d.relative_to(ROOT))
        for pkg in PACKAGES
        for d in [ROOT / pkg, *(p for p in (ROOT / pkg).rglob("*") if p.is_dir())]
        if d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()
    ]
    assert not missing


def test_defaults_file_is_one_file():
    # The package loads its defaults from inside itself; in the repository that file is a
    # link to the root's dask-config.yaml, so the two can never drift.
    from pipeline import config

    packaged = Path(config.DEFAULTS_PATH)
    assert packaged.parent == ROOT / "pipeline"
    assert (ROOT / "pipeline" / "dask-config.yaml").is_symlink()
    assert packaged.resolve() == (ROOT / "dask-config.yaml").resolve()


# The one exception: the hash byte layout is specified where it is implemented.
DOCSTRING_EXCEPTIONS = {"tasks/hashing.py"}
MAX_DOCSTRING_LINES = 20


@pytest.mark.parametrize("pkg", PACKAGES)
def test_module_docstrings_are_short(pkg):
    # Long design text lives in docs/design.md; a module says what it is for.
    long = {}
    for path in sorted((ROOT / pkg).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if len(doc.splitlines()) > MAX_DOCSTRING_LINES and rel not in DOCSTRING_EXCEPTIONS:
            long[rel] = len(doc.splitlines())
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the design text to docs/design.md): {long}"


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_no_module_over_500_lines():
    # One concept per module: a module past this has more than one in it.
    big = {str(p.relative_to(ROOT)): n for p in module_files().values() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_no_function_over_80_lines():
    # A function fits on a screen or two; a longer one does several things.
    long = {}
    for path in module_files().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
