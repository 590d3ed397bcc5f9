"""Owns ``doctor``'s b12x block: which b12x runs, its compile sites read from its source, who persists each.

Reads b12x's source (never imports it). b12x's sites are its one wrapper (the table's row) and the
kernel functions behind it: every function that calls b12x's ``compile`` or ``launch``
(``b12x._lib.compiler``), whose compiles all reach the wrapper. A ``cute.compile`` anywhere else
in b12x's tree would reach the hook under no row: listed as persisted by nothing.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path
from typing import Any

from .. import config
from ..core.adapter import module_dir
from . import adapter, sites
from .names import B12X

OURS, B12XS, NOTHING = "cute-diskcache", "b12x", "nothing"
_ENTRY_POINTS = ("compile", "launch")


def _compile_names(tree: ast.Module) -> set[str]:
    """Local names bound to b12x's ``compile`` / ``launch`` by ``from ...compiler import``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").rpartition(".")[2] == "compiler" and \
                (node.level > 0 or (node.module or "").startswith(B12X + ".")):
            names.update(a.asname or a.name for a in node.names if a.name in _ENTRY_POINTS)
    return names


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


def _calls(fn: ast.AST, names: set[str]) -> tuple[bool, bool]:
    """(calls b12x's compile or launch, calls ``cute.compile`` itself) in ``fn``'s own body."""
    entry = direct = False
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        f = node.func.value if isinstance(node.func, ast.Subscript) else node.func
        if isinstance(f, ast.Name) and f.id in names:
            entry = True
        elif isinstance(f, ast.Attribute) and f.attr == "compile" and isinstance(f.value, ast.Name) and f.value.id == "cute":
            direct = True
    return entry, direct


def scan(root: Path) -> list[dict[str, Any]]:
    """b12x's compile sites under ``root``: the wrapper, the kernels behind it, stray compiles."""
    return [dict(site) for site in _scan(root)]


@functools.lru_cache(maxsize=4)
def _scan(root: Path) -> tuple[dict[str, Any], ...]:
    """Once per process and root: ~500 files parsed (b12x is not reinstalled under a running doctor)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        names = _compile_names(tree)
        for qualname, fn in _qualnames(tree):
            entry, direct = _calls(fn, names)
            if (rel, qualname) in sites.BY_WHERE:
                found.append({"file": rel, "function": qualname, "role": "wrapper"})
            elif direct and rel != sites.COMPILER_FILE:
                found.append({"file": rel, "function": qualname, "role": "direct"})
            elif entry:
                found.append({"file": rel, "function": qualname, "role": "kernel"})
    return tuple(found)


def missing_planning_api(root: Path) -> list[str]:
    """What of :data:`.sites.PLANNING_API` this b12x's source lacks (``file:name``); [] when prewarm can plan it."""
    missing = []
    for rel, names in sites.PLANNING_API.items():
        try:
            tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            missing += [f"{rel}:{n}" for n in names]
            continue
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        missing += [f"{rel}:{n}" for n in names if n not in defined]
    return missing


def prewarm_refusal(root: Path, version: str) -> str | None:
    """Why ``prewarm --linear-backend b12x`` cannot plan this b12x offline, or None when it can."""
    missing = missing_planning_api(root)
    if not missing:
        return None
    return (f"b12x {version} has no offline planning API ({', '.join(missing)}; b12x >= 1.5.0 has it): "
            "prewarm cannot plan its kernels (those it compiles through its wrapper at run time are persisted all the same)")


def _cache_dir() -> Path:
    """b12x's disk cache directory, as ``_lib/compiler.py::_cute_compile_cache_dir`` finds it."""
    if os.environ.get("B12X_COMPILE_CACHE_DIR"):
        return Path(os.environ["B12X_COMPILE_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "b12x" / "compile"
    return Path.home() / ".cache" / "b12x" / "compile"


def _planned(site: dict[str, Any], refused: str | None) -> str | None:
    """The prewarm flags that plan ``site``'s compiles into our cache (:data:`.sites.PLANNED`), or
    None: prewarm cannot plan this b12x, the site's kernels are not ours to fill (b12x's own cache
    keeps them), or vLLM's warm-up reaches it only on the card."""
    if refused or site["status"] != OURS or site["role"] != "kernel":
        return None
    return sites.PLANNED.get((site["file"], site["function"]))


def report() -> dict[str, Any]:
    """The b12x block: version, where its code comes from, its cache and switches, its sites."""
    root = adapter.package_dir()
    if root is None:
        flashinfer = module_dir("flashinfer")
        embedded = bool(module_dir(B12X) and flashinfer and
                        os.path.isfile(os.path.join(flashinfer, "experimental", B12X, sites.COMPILER_FILE)))
        return {"b12x": None, "embedded_alias": embedded, "sites": [], "summary": {}}
    left = config.left_to_library(B12X)
    disk_on = os.environ.get("B12X_COMPILE_DISK_CACHE", "1").lower() not in ("0", "false", "no", "")
    served = B12XS if left and disk_on else NOTHING if left else OURS
    found = scan(Path(root))
    refused = prewarm_refusal(Path(root), adapter.version())
    for site in found:
        site["status"] = NOTHING if site["role"] == "direct" else served
        site["planned"] = _planned(site, refused)
    planned = sum(1 for f in found if f["planned"])
    for site in found:
        if site["role"] == "wrapper":
            site["planned"] = f"{planned} of {sum(1 for f in found if f['role'] == 'kernel')} kernel functions"
    cache = _cache_dir()
    summary = {s: sum(1 for f in found if f["status"] == s) for s in (OURS, B12XS, NOTHING)}
    return {
        "b12x": adapter.version(),
        "b12x_dir": root,
        "native": left,
        "cache_dir": str(cache),
        "disk_cache": disk_on,
        "b12x_entries": sum(1 for _ in cache.rglob("*.o")) if cache.is_dir() else 0,
        "sites": found,
        "summary": summary,
        "planned": planned,
        "prewarm_refused": refused,
        "missing_adapter_sites": sorted(f"{r.file}:{r.function}" for r in sites.ROWS
                                        if not any(f["role"] == "wrapper" and (f["file"], f["function"]) == (r.file, r.function)
                                                   for f in found)),
    }


def _plans_text(site: dict[str, Any]) -> str:
    """A site's "prewarm plans" cell: the flags, the wrapper's count, or "no"."""
    return str(site.get("planned") or "no")


def render(rep: dict[str, Any], show_all: bool = False) -> list[str]:
    """The block as ``doctor`` prints it."""
    if rep.get("b12x") is None:
        if rep.get("embedded_alias"):
            return ["b12x             flashinfer's embedded copy (the `b12x` alias): its sites are flashinfer's, above"]
        return ["b12x             not installed"]
    summary = rep["summary"]
    kernels = [s for s in rep["sites"] if s["role"] == "kernel"]
    lines = [
        f"b12x             {rep['b12x']}  ({rep['b12x_dir']})",
        f"  b12x cache     {rep['cache_dir']}  ({'on' if rep['disk_cache'] else 'OFF (B12X_COMPILE_DISK_CACHE=0)'}; "
        f"{rep['b12x_entries']} b12x entries)" + ("" if rep["native"] else ", stands aside for b12x's compiles: ours serves them"),
        f"b12x compile sites: {len(rep['sites'])}  " + "  ".join(f"{k} {v}" for k, v in summary.items()),
    ]
    # The planned kernel functions always: which of b12x's kernels a deploy can have before the engine starts.
    shown = [s for s in rep["sites"] if s["role"] != "kernel" or show_all or s.get("planned")]
    width = max([len(f"{s['file']}:{s['function']}") for s in shown] + [4])
    plans = max([len(_plans_text(s)) for s in shown] + [13])
    lines.append(f"  {'persisted by':<15}{'site':<{width}}  {'prewarm plans':<{plans}}  how")
    for s in shown:
        how = {"wrapper": sites.NOTE if s["status"] == OURS else "b12x's one compile wrapper, left to b12x's own disk cache"
               + (" (CUTE_DISKCACHE_NATIVE_SITES names b12x)" if rep["native"] else ""),
               "kernel": "through the wrapper",
               "direct": "calls cute.compile outside b12x's wrapper: no row covers it"}[s["role"]]
        lines.append(f"  {s['status']:<15}{s['file'] + ':' + s['function']:<{width}}  {_plans_text(s):<{plans}}  {how}")
    hidden = [s for s in kernels if s not in shown]
    if hidden:
        lines.append(f"  ... and {len(hidden)} more kernel functions behind the wrapper, each persisted by "
                     f"{hidden[0]['status']}, none planned by prewarm: compiled at the engine's first start (--all lists them)")
    if rep.get("prewarm_refused"):
        lines.append(f"b12x prewarm     refused: {rep['prewarm_refused']}")
    if rep.get("missing_adapter_sites"):
        lines += ["adapter sites not found in this b12x's source (renamed or reworked upstream):",
                  *(f"  {m}" for m in rep["missing_adapter_sites"])]
    return lines
