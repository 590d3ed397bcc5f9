"""Owns ``doctor``'s SGLang block: which SGLang runs, its ``cute.compile`` sites read from its source, who persists each.

Reads SGLang's source (never imports it: importing SGLang loads its whole serving stack). A site is
a function that calls ``cute.compile`` (or ``cute.compile[...]``) itself, outside ``multimodal_gen/``
and test code. Each is persisted by us (a row of :mod:`.sites`), by SGLang's ``cute_aot`` cache (the
FA4 rows when ``CUTE_DISKCACHE_NATIVE_SITES`` names sglang, and the functions of
:data:`.sites.SGLANG_PERSISTED`), or by nothing (SGLang keeps it in a dict: every start compiles
again). ``docs/versions.md`` says which of them an sm12x engine start reaches, and with which flag.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path
from typing import Any

from .. import config
from . import adapter, sites
from .names import SGLANG

OURS, SGLANGS, NOTHING = "cute-diskcache", "sglang", "nothing"
_SKIPPED = ("multimodal_gen/", "test/")


def _qualnames(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """Every function with its qualified name (nested functions without ``<locals>``)."""
    out: list[tuple[str, ast.AST]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def _compiles(fn: ast.AST) -> bool:
    """``fn``'s own body calls ``cute.compile`` (nested functions are sites of their own)."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            f = node.func.value if isinstance(node.func, ast.Subscript) else node.func
            if isinstance(f, ast.Attribute) and f.attr == "compile" and isinstance(f.value, ast.Name) and f.value.id == "cute":
                return True
        todo.extend(ast.iter_child_nodes(node))
    return False


def scan(root: Path) -> list[dict[str, Any]]:
    """SGLang's compile sites under ``root``: ``{"file", "function"}`` per function that compiles."""
    return [dict(site) for site in _scan(root)]


@functools.lru_cache(maxsize=4)
def _scan(root: Path) -> tuple[dict[str, Any], ...]:
    """Once per process and root (~4,000 files; SGLang is not reinstalled under a running doctor)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(_SKIPPED) or "/test/" in rel or "/tests/" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
            if "cute.compile" not in text:
                continue
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        found += [{"file": rel, "function": q} for q, fn in _qualnames(tree) if _compiles(fn)]
    return tuple(found)


def _status(site: dict[str, Any], left: bool) -> str:
    where = (site["file"], site["function"])
    row = sites.BY_WHERE.get(where)
    if row is not None and not left:
        return OURS
    if where in sites.SGLANG_PERSISTED or (row is not None and row.file == sites.FA4_INTERFACE_FILE):
        return SGLANGS
    return NOTHING


def _aot_dir() -> str:
    """SGLang's ``cute_aot`` root, as ``srt/environ.py`` defaults it (``""`` turns it off)."""
    if "SGLANG_CUTE_AOT_CACHE_DIR" in os.environ:
        return os.environ["SGLANG_CUTE_AOT_CACHE_DIR"]
    base = os.environ.get("SGLANG_CACHE_DIR") or os.path.join(Path.home(), ".cache", SGLANG)
    return os.path.join(base, "cute_aot")


def report() -> dict[str, Any]:
    """The SGLang block: version, its cache and switch, its sites and who persists each."""
    root = adapter.package_dir()
    if root is None:
        return {"sglang": None, "sites": [], "summary": {}}
    left = config.left_to_library(SGLANG)
    found = scan(Path(root))
    for site in found:
        site["status"] = _status(site, left)
        site["row"] = (site["file"], site["function"]) in sites.BY_WHERE
    aot = _aot_dir()
    return {
        "sglang": adapter.version(),
        "sglang_dir": root,
        "native": left,
        "aot_dir": aot,
        "aot_objects": sum(1 for _ in Path(aot).rglob("*.o")) if aot and Path(aot).is_dir() else 0,
        "sites": found,
        "summary": {s: sum(1 for f in found if f["status"] == s) for s in (OURS, SGLANGS, NOTHING)},
        "missing_adapter_sites": sorted(f"{r.file}:{r.function}" for r in sites.ROWS
                                        if not any((f["file"], f["function"]) == (r.file, r.function) for f in found)),
    }


def strict_failure(rep: dict[str, Any]) -> bool:
    """A row no longer in SGLang's source, or a row's kernels persisted by nothing."""
    return bool(rep.get("missing_adapter_sites")) or any(s["row"] and s["status"] == NOTHING for s in rep.get("sites", []))


def render(rep: dict[str, Any], show_all: bool = False) -> list[str]:
    """The block as ``doctor`` prints it: the rows always, every other site with ``--all``."""
    if rep.get("sglang") is None:
        return ["sglang           not installed"]
    aot = rep["aot_dir"] or "off (SGLANG_CUTE_AOT_CACHE_DIR is empty)"
    lines = [
        f"sglang           {rep['sglang']}  ({rep['sglang_dir']})",
        f"  sglang cache   {aot}  ({rep['aot_objects']} objects)"
        + (" (CUTE_DISKCACHE_NATIVE_SITES names sglang: FA4 left to it)" if rep["native"]
           else ", stands aside for the FA4 kernels: ours serves them"),
        f"sglang compile sites: {len(rep['sites'])}  " + "  ".join(f"{k} {v}" for k, v in rep["summary"].items()),
    ]
    shown = [s for s in rep["sites"] if s["row"] or show_all]
    width = max([len(f"{s['file']}:{s['function']}") for s in shown] + [4])
    lines.append(f"  {'persisted by':<15}{'site':<{width}}  how")
    for s in shown:
        how = sites.NOTE if s["status"] == OURS else (
            "SGLang's cute_aot cache" if s["status"] == SGLANGS else "in memory only: compiled at every start")
        lines.append(f"  {s['status']:<15}{s['file'] + ':' + s['function']:<{width}}  {how}")
    others = len(rep["sites"]) - len(shown)
    if others:
        lines.append(f"  ... and {others} sites without a row: SM100-only, opt-in or model-specific (--all lists them; "
                     "docs/versions.md says which flag selects each and whether sm12x runs it)")
    if rep.get("missing_adapter_sites"):
        lines += ["adapter sites not found in this SGLang's source (renamed or reworked upstream):",
                  *(f"  {m}" for m in rep["missing_adapter_sites"])]
    return lines
