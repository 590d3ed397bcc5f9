"""Owns ``doctor``'s vLLM block: which vLLM runs, its own ``cute.compile`` sites read from its source,
who persists each and which prewarm plans.

Reads vLLM's source (never imports it: ``vllm`` loads its serving stack). A site is a function that
calls ``cute.compile`` (or ``cute.compile[...]``) itself, outside its vendored FlashAttention
(``vllm_flash_attn/``, FA4 for SM90 / SM100) and test code. Each is persisted by us (a row of
:mod:`.sites`) or left to vLLM, which keeps them in memory: most are model-specific or for SM90 /
SM100 (``docs/design-vllm-sites.md`` section 3 says which an sm12x start reaches).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import config
from ..core import sitescan
from . import adapter, sites
from .names import VLLM

OURS, VLLMS = "cute-diskcache", "vllm"
_SKIPPED = ("vllm_flash_attn/",)


def _skipped(rel: str) -> bool:
    return rel.startswith(_SKIPPED) or "/tests/" in rel or "/test/" in rel


def scan(root: Path) -> list[dict[str, Any]]:
    """vLLM's compile sites under ``root``: ``{"file", "function"}`` per function that compiles
    (~3,600 files, those that name ``cute.compile`` parsed; nested functions are sites of their own)."""
    return sitescan.compiling(root, _skipped)


def planning_gap(root: Path) -> list[str]:
    """What of :data:`.sites.PLANNING_API` this vLLM lacks (``file:name``): with any, prewarm plans
    nothing of vLLM's (an older vLLM has no plan table); its row still serves the compiles it makes."""
    return sitescan.missing_definitions(root, sites.PLANNING_API)


def report() -> dict[str, Any]:
    """The vLLM block: version, its sites, who persists each and which prewarm plans."""
    root = adapter.package_dir()
    if root is None:
        return {"vllm": None, "sites": [], "summary": {}}
    left = config.left_to_library(VLLM)
    found = scan(Path(root))
    for site in found:
        where = (site["file"], site["function"])
        site["row"] = where in sites.BY_WHERE
        site["status"] = OURS if site["row"] and not left else VLLMS
        site["planned"] = sites.PLANNED.get(where, "") if site["row"] and not left else ""
    return {
        "vllm": adapter.version(),
        "vllm_dir": root,
        "native": left,
        "planning_gap": planning_gap(Path(root)),
        "sites": found,
        "summary": {s: sum(1 for f in found if f["status"] == s) for s in (OURS, VLLMS)},
        "missing_adapter_sites": sitescan.missing_rows(sites.ROWS, found),
    }


def strict_failure(rep: dict[str, Any]) -> bool:
    """A row no longer in vLLM's source."""
    return bool(rep.get("missing_adapter_sites"))


def render(rep: dict[str, Any], show_all: bool = False) -> list[str]:
    """The block as ``doctor`` prints it: the rows always, every other site with ``--all``."""
    if rep.get("vllm") is None:
        return ["vllm             not installed"]
    shown = [s for s in rep["sites"] if s["row"] or show_all]
    lines = [
        f"vllm             {rep['vllm']}  ({rep['vllm_dir']})"
        + ("  (CUTE_DISKCACHE_NATIVE_SITES names vllm: its kernels left to its in-memory dicts)" if rep["native"] else ""),
        *sitescan.table(VLLM, rep, shown, lambda s: sites.NOTE if s["status"] == OURS else "vLLM's: in memory only",
                        plans=lambda s: s["planned"] or "no"),
    ]
    if rep["planning_gap"]:
        lines.append(f"  prewarm plans nothing of this vLLM: it lacks {', '.join(rep['planning_gap'])} (its row still serves what it compiles)")
    others = len(rep["sites"]) - len(shown)
    if others:
        lines.append(f"  ... and {others} sites without a row: SM90 / SM100-only or model-specific (--all lists them; "
                     "docs/design-vllm-sites.md section 3)")
    return lines + sitescan.missing_lines("vLLM", rep)
