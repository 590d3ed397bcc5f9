"""``doctor``'s library-neutral reading of a library's source (parsed, never imported): its
functions by qualified name and what they call, what of a planning API a release lacks, and the
site table each library's block prints. Each adapter's ``scan.py`` brings its tables and says who
persists each site; the walking, parsing and caching are here, so that the blocks agree on what a
function and a compile are.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .adapter import Row

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


class Function(NamedTuple):
    """One function of the library's source and the calls that make it a site."""

    file: str  # relative to the root, '/'-separated
    function: str  # qualified name without ``<locals>`` ("launch_fwd._compile", "Cls.method")
    entry: bool  # calls one of the names ``entry_names`` found in its file (the library's own compile wrapper)
    compiles: bool  # calls ``cute.compile`` (or ``cute.compile[...]``) itself


@functools.lru_cache(maxsize=8)
def functions(root: Path, entry_names: Callable[[ast.Module], set[str]] | None = None, skip: Callable[[str], bool] | None = None,
              needle: str = "", own_body: bool = False) -> tuple[Function, ...]:
    """Every function under ``root`` (files in sorted order), but in files ``skip`` names (by their
    path under ``root``), whose text lacks ``needle`` or that do not parse. ``own_body``: a nested
    function's, class's or lambda's calls are not its parent's. Once per process and arguments
    (hundreds or thousands of files; a library is not reinstalled under a running doctor)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if skip is not None and skip(rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            if needle not in text:
                continue
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        names = entry_names(tree) if entry_names is not None else set()
        for qualname, fn in _qualnames(tree, ""):
            callees = list(_callees(fn, own_body))
            found.append(Function(rel, qualname, any(isinstance(f, ast.Name) and f.id in names for f in callees),
                                  any(isinstance(f, ast.Attribute) and f.attr == "compile" and isinstance(f.value, ast.Name)
                                      and f.value.id == "cute" for f in callees)))
    return tuple(found)


def compiling(root: Path, skip: Callable[[str], bool]) -> list[dict[str, Any]]:
    """``{"file", "function"}`` of each function under ``root`` that calls ``cute.compile`` itself (a
    nested function is a site of its own), but in files ``skip`` names: a library that compiles at
    its sites, not through a wrapper of its own (SGLang's, vLLM's)."""
    return [{"file": f.file, "function": f.function} for f in functions(root, skip=skip, needle="cute.compile", own_body=True) if f.compiles]


def _qualnames(node: ast.AST, prefix: str) -> Iterable[tuple[str, ast.AST]]:
    """Every function under ``node`` with its qualified name (nested functions without ``<locals>``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _FUNCTIONS):
            yield prefix + child.name, child
            yield from _qualnames(child, prefix + child.name + ".")
        else:
            yield from _qualnames(child, prefix + child.name + "." if isinstance(child, ast.ClassDef) else prefix)


def _callees(fn: ast.AST, own_body: bool) -> Iterable[ast.expr]:
    """What each call in ``fn`` calls (``f[...](...)`` calls ``f``); with ``own_body``, not inside a
    nested function, class or lambda."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if own_body and isinstance(node, (*_FUNCTIONS, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node.func.value if isinstance(node.func, ast.Subscript) else node.func
        todo.extend(ast.iter_child_nodes(node))


def missing_definitions(root: Path, api: Mapping[str, Iterable[str]]) -> list[str]:
    """What of ``api`` (file under ``root`` -> the functions, classes and tables it must define at its
    top level) this release lacks, as ``file:name``; [] when it has all (a file that does not parse lacks all of its names)."""
    missing = []
    for rel, names in api.items():
        try:
            tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            missing += [f"{rel}:{n}" for n in names]
            continue
        defined = {node.name for node in tree.body if isinstance(node, (*_FUNCTIONS, ast.ClassDef))}
        defined |= {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))  # a table: vLLM's plans
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
        missing += [f"{rel}:{n}" for n in names if n not in defined]
    return missing


def missing_rows(rows: Iterable[Row], found: Iterable[dict[str, Any]]) -> list[str]:
    """``file:function`` of each row that no found site is: renamed or reworked upstream."""
    where = {(f["file"], f["function"]) for f in found}
    return sorted(f"{r.file}:{r.function}" for r in rows if (r.file, r.function) not in where)


def table(library: str, rep: dict[str, Any], shown: list[dict[str, Any]], how: Callable[[dict[str, Any]], str],
          plans: Callable[[dict[str, Any]], str] | None = None) -> list[str]:
    """A block's sites as ``doctor`` prints them: the count by who persists them, then a row per
    ``shown`` site (who persists it, where, with ``plans`` what prewarm plans, ``how``)."""
    width = max([len(f"{s['file']}:{s['function']}") for s in shown] + [4])
    cells = max([len(plans(s)) for s in shown] + [13]) if plans else 0
    plan = (lambda s: "") if plans is None else (lambda s: f"{plans(s):<{cells}}  ")
    return [f"{library} compile sites: {len(rep['sites'])}  " + "  ".join(f"{k} {v}" for k, v in rep["summary"].items()),
            f"  {'persisted by':<15}{'site':<{width}}  " + (f"{'prewarm plans':<{cells}}  " if plans else "") + "how",
            *(f"  {s['status']:<15}{s['file'] + ':' + s['function']:<{width}}  {plan(s)}{how(s)}" for s in shown)]


def missing_lines(library: str, rep: dict[str, Any]) -> list[str]:
    """The block's closing lines: the rows this release's source lacks, if any."""
    missing = rep.get("missing_adapter_sites")
    return [f"adapter sites not found in this {library}'s source (renamed or reworked upstream):", *(f"  {m}" for m in missing)] if missing else []
