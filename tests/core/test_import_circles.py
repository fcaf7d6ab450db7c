"""No two modules of src/shmeval import each other, directly or through a
circle of others: imports run one way.

What counts is what runs when a module is imported: its module-level
imports, those under ``if``/``try`` and in class bodies included.  Those are
the circles that do harm: the module imported second sees the first one
half-initialised, and a name it imports from it may not be defined yet,
so whether an import works depends on which module a program happened to
import first.  Imports inside functions run later, when both modules are
whole, and are left out, as are those under ``if TYPE_CHECKING:``, which
never run.

Read from the source, not from sys.modules, so it runs on a clean clone
without a build: the compiled modules (``.pyx``) count, with their
module-level Python imports (``cimport`` is the compiler's).  Importing a
module runs its packages' ``__init__`` first; a module's own packages are
already being imported by then, so an edge to one counts only where the
module takes a name the package's ``__init__`` defines (``from . import
Evaluator``), not one of its submodules (``from . import _ring``)."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "shmeval"

#: An import statement at column 0 of a Cython file (module level there),
#: with its parenthesised or backslashed continuation lines.
_PYX_IMPORT = re.compile(r"^(?:import|from)\s(?:[^\n(\\]|\\\n)*(?:\([^)]*\)[^\n]*)?",
                         re.MULTILINE)
_PYX_INCLUDE = re.compile(r'^include\s+"([^"]+)"', re.MULTILINE)

#: importer -> {imported: line of the first import of it}
Graph = Dict[str, Dict[str, int]]


def module_files(package: Path) -> Dict[str, Path]:
    """Every module of ``package`` (``.py`` and ``.pyx``) by dotted name."""
    out: Dict[str, Path] = {}
    for path in sorted(package.rglob("*")):
        if path.suffix not in (".py", ".pyx"):
            continue
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _run_at_import(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """The import statements of ``body`` that run when the module is
    imported: not in functions, not under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _run_at_import(node.orelse)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _run_at_import([child])
                elif isinstance(child, (ast.ExceptHandler, ast.match_case)):
                    yield from _run_at_import(child.body)


def _statements(path: Path) -> List[ast.stmt]:
    """The imports that run when the module of ``path`` is imported (for a
    Cython file, with the files it includes)."""
    text = path.read_text()
    if path.suffix == ".py":
        return list(_run_at_import(ast.parse(text).body))
    text += "".join("\n" + (path.parent / name).read_text()
                    for name in _PYX_INCLUDE.findall(text))
    found: List[ast.stmt] = []
    for m in _PYX_IMPORT.finditer(text):
        if re.search(r"\bcimport\b", m.group(0)):
            continue
        try:
            found.extend(ast.parse(m.group(0)).body)
        except SyntaxError:   # prose at column 0 in a docstring
            continue
    return found


def _targets(node: ast.stmt, module: str, is_package: bool, modules: Set[str]) -> Set[str]:
    """The modules of ``modules`` an import statement of ``module`` runs or
    takes names from: the module imported and the packages above it, but
    of ``module``'s own packages (imported before it) only one it takes a
    name from."""
    own = {module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)}

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    def with_packages(name: str) -> Set[str]:
        parts = owner(name).split(".")
        above = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        return {m for m in above if m in modules and m not in own}

    if isinstance(node, ast.Import):
        return set().union(*(with_packages(a.name) for a in node.names))
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = (module if is_package else module.rpartition(".")[0]).split(".")
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = with_packages(source)
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        found |= with_packages(sub) if sub in modules else {owner(source)}
    return found - {"", module}


def import_graph(package: Path) -> Graph:
    graph: Graph = {}
    files = module_files(package)
    for module, path in files.items():
        edges: Dict[str, int] = {}
        for node in _statements(path):
            for target in sorted(_targets(node, module, path.name == "__init__.py", set(files))):
                edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def circles(graph: Graph) -> List[List[str]]:
    """One circle per strongly connected component of more than one module
    (Tarjan's algorithm): a shortest one from its first module back to it."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_loop(graph, comp) for comp in components]


def _loop(graph: Graph, comp: List[str]) -> List[str]:
    """A shortest circle from comp[0] back to itself within comp."""
    start, inside = comp[0], set(comp)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                return paths[v] + [start]
            if w in inside and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"{comp} is not a circle")   # pragma: no cover


def describe(graph: Graph, files: Dict[str, Path], loop: List[str]) -> str:
    """``a (src/a.py:12) -> b (src/b.py:30) -> a``: where each imports the next."""
    steps = [f"{a} ({files[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in zip(loop, loop[1:])]
    return " -> ".join(steps + [loop[-1]])


def test_no_import_circles() -> None:
    graph = import_graph(PACKAGE)
    files = module_files(PACKAGE)
    found = [describe(graph, files, c) for c in circles(graph)]
    assert found == [], "import circles in src/shmeval:\n" + "\n".join(found)


def test_the_graph_is_read() -> None:
    """The reading finds imports of every kind it relies on (a graph read
    as empty would have no circles): relative, into a subpackage, of a
    compiled module, and a compiled module's own."""
    g = import_graph(PACKAGE)
    assert "shmeval.waiting" in g["shmeval.tuning"]
    assert "shmeval._ring" in g["shmeval.tuning"]            # from . import _ring
    assert "shmeval.errors" in g["shmeval._ring"]            # _ring.pyx's Python import
    assert "shmeval.backends._device" in g["shmeval.evaluator"]
    assert "shmeval.tuning" not in g["shmeval.waiting"]


def write(root: Path, files: Dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files, expect", [
    # one module importing another that imports it back
    ({"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "from .a import x\n"},
     [["pkg.a", "pkg.b", "pkg.a"]]),
    # through a third, an absolute import and a subpackage
    ({"pkg/__init__.py": "", "pkg/a.py": "import pkg.sub.c\n", "pkg/b.py": "from . import a\n",
      "pkg/sub/__init__.py": "", "pkg/sub/c.py": "from ..b import y\n"},
     [["pkg.a", "pkg.sub.c", "pkg.b", "pkg.a"]]),
    # under try/if and in a class body: they run at import
    ({"pkg/__init__.py": "", "pkg/a.py": "try:\n    from . import b\nexcept ImportError:\n    pass\n",
      "pkg/b.py": "class C:\n    if True:\n        from .a import x\n"},
     [["pkg.a", "pkg.b", "pkg.a"]]),
    # a name of a package's __init__ that imports the module back
    ({"pkg/__init__.py": "from .a import A\n", "pkg/a.py": "from . import VERSION\n"},
     [["pkg", "pkg.a", "pkg"]]),
    # the package above a module imported runs first
    ({"pkg/__init__.py": "", "pkg/a.py": "from .sub.c import x\n",
      "pkg/sub/__init__.py": "from .. import a\n", "pkg/sub/c.py": "x = 1\n"},
     [["pkg.a", "pkg.sub", "pkg.a"]]),
    # a compiled module's import, and one in a file it includes
    ({"pkg/__init__.py": "", "pkg/_c.pyx": "cimport numpy\nfrom pkg.b import (x,\n    y)\n",
      "pkg/b.py": "from . import _c\n"},
     [["pkg._c", "pkg.b", "pkg._c"]]),
    ({"pkg/__init__.py": "", "pkg/_c.pyx": 'include "inc/d.pxi"\n',
      "pkg/inc/d.pxi": "from libc.stdint cimport uint64_t\nimport pkg.b\n",
      "pkg/b.py": "from . import _c\n"},
     [["pkg._c", "pkg.b", "pkg._c"]]),
    # none: inside a function, under TYPE_CHECKING, a submodule of the own package
    ({"pkg/__init__.py": "from .a import A\n",
      "pkg/a.py": "from typing import TYPE_CHECKING\nfrom . import b\nif TYPE_CHECKING:\n"
                  "    from .c import C\n",
      "pkg/b.py": "def f():\n    from . import a\n",
      "pkg/c.py": "from . import a\n"},
     []),
])
def test_circles_found(tmp_path: Path, files: Dict[str, str],
                       expect: List[List[str]]) -> None:
    """The reading on small made-up packages: each kind of circle is found,
    and the imports that run later or never are not circles."""
    assert circles(import_graph(write(tmp_path, files))) == expect
