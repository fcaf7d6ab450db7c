"""Where the main script defines a name, as a process started with
multiprocessing's spawn or forkserver method will see it.

Such a process imports the parent's main script again (as ``__mp_main__``)
and finds a pickled function or class there by name.  The import runs the
script's top level but not its ``if __name__ == "__main__":`` block, so a
factory defined inside that block, or in an interactive session (whose
``__main__`` is no file), exists in the parent only: the child dies
unpickling it, before any of shmeval's code runs.  ``unreachable_reason``
says so before the child is started."""
from __future__ import annotations

import ast
import functools
import sys
from typing import Any, Iterator, Optional


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either way round)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _bound(body: list[ast.stmt]) -> Iterator[tuple[str, bool]]:
    """The names the top-level statements bind (definitions, imports and
    assignments, looking into compound statements but not into functions
    or classes), each with whether only the main guard's block binds it
    there (its ``else`` runs in the child too)."""
    for stmt in body:
        if _is_main_guard(stmt):
            assert isinstance(stmt, ast.If)
            parts = [(stmt.body, True), (stmt.orelse, False)]
        else:
            parts = [([stmt], False)]
        for stmts, guarded in parts:
            for part in stmts:
                for node in _walk_level(part):
                    for name in _names(node):
                        yield name, guarded


def _names(node: ast.AST) -> Iterator[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        for alias in node.names:
            yield (alias.asname or alias.name).split(".")[0]
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        yield node.id


def _walk_level(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and what it holds, without entering function or class
    bodies (their names are bound elsewhere) but yielding the definitions."""
    yield node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk_level(child)


def defined_only_under_main_guard(source: str, name: str) -> bool:
    """Whether module ``source`` binds ``name`` at its top level only inside
    an ``if __name__ == "__main__":`` block.  False when it binds it outside
    one as well (or may, through a star import), not at all, or the source
    does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    bound = list(_bound(tree.body))
    if ("*", False) in bound:  # a star import may bind it anywhere
        return False
    return {guarded for n, guarded in bound if n == name} == {True}


def from_main(obj: Any) -> Optional[Any]:
    """The function or class under ``obj``'s functools.partial layers when
    the main script defines it (its ``__module__`` is ``"__main__"``), else
    None."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    return obj if getattr(obj, "__module__", None) == "__main__" else None


def unreachable_reason(obj: Any, start_method: str) -> Optional[str]:
    """Why a process started with ``start_method`` cannot find ``obj`` (a
    function or class, or a functools.partial of one) by name, or None when
    nothing here says it cannot.  Only objects of the main script are
    looked at; "fork" children inherit everything."""
    if start_method == "fork":
        return None
    obj = from_main(obj)
    if obj is None:
        return None
    name = getattr(obj, "__qualname__", "")
    if not name or "." in name:  # nested: pickling it fails anyway, and says so
        return None
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return (f"{name!r} is defined in an interactive session or a `python -c` string "
                f"(the __main__ module has no file), which a process started with "
                f"{start_method!r} cannot import: define it in a module that it can "
                f"import (a .py file, imported here), or pass mp_context='fork'")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    if defined_only_under_main_guard(source, name):
        return (f"{name!r} is defined inside the `if __name__ == \"__main__\":` block of "
                f"{path}; a process started with {start_method!r} imports the script "
                f"without running that block and cannot find it: define it at the "
                f"script's top level, before the block")
    return None
