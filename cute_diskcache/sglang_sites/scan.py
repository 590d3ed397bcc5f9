"""Owns ``doctor``'s SGLang block: which SGLang runs, its ``cute.compile`` sites read from its source, who persists each.

Reads SGLang's source (never imports it: importing SGLang loads its whole serving stack). A site is
a function that calls ``cute.compile`` (or ``cute.compile[...]``) itself, outside ``multimodal_gen/``
and test code. Each is persisted by us (a row of :mod:`.sites`), by SGLang's ``cute_aot`` cache (the
FA4 rows when ``CUTE_DISKCACHE_NATIVE_SITES`` names sglang, and the functions of
:data:`.sites.SGLANG_PERSISTED`), or by nothing (SGLang keeps it in a dict: every start compiles
again). ``docs/versions.md`` says which of them an sm12x engine start reaches, and with which flag.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import config
from ..core import sitescan
from . import adapter, sites
from .names import SGLANG

OURS, SGLANGS, NOTHING = "cute-diskcache", "sglang", "nothing"
_SKIPPED = ("multimodal_gen/", "test/")


def _skipped(rel: str) -> bool:
    """Not an engine's code: the multimodal generation tree and test code."""
    return rel.startswith(_SKIPPED) or "/test/" in rel or "/tests/" in rel


def scan(root: Path) -> list[dict[str, Any]]:
    """SGLang's compile sites under ``root``: ``{"file", "function"}`` per function that compiles
    (~4,000 files, those that name ``cute.compile`` parsed; nested functions are sites of their own)."""
    return sitescan.compiling(root, _skipped)


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
        "missing_adapter_sites": sitescan.missing_rows(sites.ROWS, found),
    }


def strict_failure(rep: dict[str, Any]) -> bool:
    """A row no longer in SGLang's source, or a row's kernels persisted by nothing."""
    return bool(rep.get("missing_adapter_sites")) or any(s["row"] and s["status"] == NOTHING for s in rep.get("sites", []))


def render(rep: dict[str, Any], show_all: bool = False) -> list[str]:
    """The block as ``doctor`` prints it: the rows always, every other site with ``--all``."""
    if rep.get("sglang") is None:
        return ["sglang           not installed"]
    aot = rep["aot_dir"] or "off (SGLANG_CUTE_AOT_CACHE_DIR is empty)"
    shown = [s for s in rep["sites"] if s["row"] or show_all]
    lines = [
        f"sglang           {rep['sglang']}  ({rep['sglang_dir']})",
        f"  sglang cache   {aot}  ({rep['aot_objects']} objects)"
        + (" (CUTE_DISKCACHE_NATIVE_SITES names sglang: FA4 left to it)" if rep["native"]
           else ", stands aside for the FA4 kernels: ours serves them"),
        *sitescan.table(SGLANG, rep, shown, lambda s: sites.NOTE if s["status"] == OURS else (
            "SGLang's cute_aot cache" if s["status"] == SGLANGS else "in memory only: compiled at every start")),
    ]
    others = len(rep["sites"]) - len(shown)
    if others:
        lines.append(f"  ... and {others} sites without a row: SM100-only, opt-in or model-specific (--all lists them; "
                     "docs/versions.md says which flag selects each and whether sm12x runs it)")
    return lines + sitescan.missing_lines("SGLang", rep)
