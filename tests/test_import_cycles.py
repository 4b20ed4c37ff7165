"""No import circles among floe's modules (issue 23, item 8).

The graph counts every import a module's source holds: module level, inside functions, and
under `if TYPE_CHECKING:` too (a circle hidden behind TYPE_CHECKING still ties the two modules
together: neither can move or be read without the other). `from a.b import c` is an edge to
the module `a.b.c` when that is a module, else to `a.b`.

Both circles of item 8 are gone (backend/sync/base.py ↔ backend/zones.py: the shared types live in
backend/weights.py; server/app.py ↔ server/protocols: ServerState lives in server/state.py), so
every package, floe.server included, must stay free of circles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import floe

SRC = Path(floe.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Module -> the floe modules it imports (every import statement in the file)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        graph[name].add(target)
                    elif base in modules:
                        graph[name].add(base)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert found == [], f"import circles: {found}"


def test_the_check_finds_a_circle_behind_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "floe" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "floe" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from floe.pkg.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from floe.pkg import a\nB = 1\n")
    assert circles(import_graph(tmp_path / "floe")) == [["floe.pkg.a", "floe.pkg.b"]]


IMPORT_EACH = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "floe" or m.startswith("floe.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as e:
        cause = e
        while cause is not None and not isinstance(cause, ModuleNotFoundError):
            cause = cause.__cause__ or cause.__context__
        if cause is None or (cause.name or "").split(".")[0] == "floe":  # not an optional stack missing here
            failed.append(f"{name}: {type(e).__name__}: {e}")
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
"""


FRESH_IMPORTS = ("floe.backend", "floe.placement", "floe.server")


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """Each module of the packages that import one another (FRESH_IMPORTS) imported first (floe's modules dropped from sys.modules in between): a circle
    through a package's __init__ fails only in some orders, e.g. floe.placement imported first."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    names = sorted(n for n in import_graph() if n.startswith(FRESH_IMPORTS))
    out = subprocess.run([sys.executable, "-c", IMPORT_EACH, *names], check=False, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", out.stdout
