"""Owns ``doctor``'s b12x block: which b12x runs, its compile sites read from its source, who persists each.

Reads b12x's source (never imports it). b12x's sites are its one wrapper (the table's row) and the
kernel functions behind it: every function that calls b12x's ``compile`` or ``launch``
(``b12x._lib.compiler``), whose compiles all reach the wrapper. A ``cute.compile`` anywhere else
in b12x's tree would reach the hook under no row: listed as persisted by nothing.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

from .. import config
from ..core import sitescan
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


def scan(root: Path) -> list[dict[str, Any]]:
    """b12x's compile sites under ``root``: the wrapper, the kernels behind it, stray compiles."""
    found = []
    for f in sitescan.functions(root, _compile_names):
        role = ("wrapper" if (f.file, f.function) in sites.BY_WHERE else "direct" if f.compiles and f.file != sites.COMPILER_FILE
                else "kernel" if f.entry else None)
        found += [{"file": f.file, "function": f.function, "role": role}] if role else []
    return found


def prewarm_refusal(root: Path, version: str) -> str | None:
    """Why ``prewarm --linear-backend b12x`` cannot plan this b12x offline (what of
    :data:`.sites.PLANNING_API` its source lacks), or None when it can."""
    missing = sitescan.missing_definitions(root, sites.PLANNING_API)
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
    return {
        "b12x": adapter.version(),
        "b12x_dir": root,
        "native": left,
        "cache_dir": str(cache),
        "disk_cache": disk_on,
        "b12x_entries": sum(1 for _ in cache.rglob("*.o")) if cache.is_dir() else 0,
        "sites": found,
        "summary": {s: sum(1 for f in found if f["status"] == s) for s in (OURS, B12XS, NOTHING)},
        "planned": planned,
        "prewarm_refused": refused,
        "missing_adapter_sites": sitescan.missing_rows(sites.ROWS, [f for f in found if f["role"] == "wrapper"]),
    }


def render(rep: dict[str, Any], show_all: bool = False) -> list[str]:
    """The block as ``doctor`` prints it."""
    if rep.get("b12x") is None:
        if rep.get("embedded_alias"):
            return ["b12x             flashinfer's embedded copy (the `b12x` alias): its sites are flashinfer's, above"]
        return ["b12x             not installed"]
    kernels = [s for s in rep["sites"] if s["role"] == "kernel"]
    # The planned kernel functions always: which of b12x's kernels a deploy can have before the engine starts.
    shown = [s for s in rep["sites"] if s["role"] != "kernel" or show_all or s.get("planned")]
    how = {"wrapper": "b12x's one compile wrapper, left to b12x's own disk cache" + (" (CUTE_DISKCACHE_NATIVE_SITES names b12x)" if rep["native"] else ""),
           "kernel": "through the wrapper", "direct": "calls cute.compile outside b12x's wrapper: no row covers it"}
    lines = [
        f"b12x             {rep['b12x']}  ({rep['b12x_dir']})",
        f"  b12x cache     {rep['cache_dir']}  ({'on' if rep['disk_cache'] else 'OFF (B12X_COMPILE_DISK_CACHE=0)'}; "
        f"{rep['b12x_entries']} b12x entries)" + ("" if rep["native"] else ", stands aside for b12x's compiles: ours serves them"),
        *sitescan.table(B12X, rep, shown, lambda s: sites.NOTE if s["role"] == "wrapper" and s["status"] == OURS else how[s["role"]],
                        lambda s: str(s.get("planned") or "no")),  # the flags, the wrapper's count, or "no"
    ]
    hidden = [s for s in kernels if s not in shown]
    if hidden:
        lines.append(f"  ... and {len(hidden)} more kernel functions behind the wrapper, each persisted by "
                     f"{hidden[0]['status']}, none planned by prewarm: compiled at the engine's first start (--all lists them)")
    if rep.get("prewarm_refused"):
        lines.append(f"b12x prewarm     refused: {rep['prewarm_refused']}")
    return lines + sitescan.missing_lines(B12X, rep)
