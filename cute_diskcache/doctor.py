"""``cute-diskcache doctor``: is every sm12x MoE compile site of this flashinfer persisted?

Reads the installed flashinfer's source (never imports it) and prints, for every CuTe-DSL
compile call under ``fused_moe/cute_dsl/blackwell_sm12x`` and ``b12x_moe.py``, whether
cute-diskcache covers it, flashinfer's own disk cache does (0.6.18+), or nothing does; plus
the versions, the cache root and the target profile in effect. A site a new release adds
shows up as "nothing" here rather than compiling silently on every start.

Exit status: 0; with ``--strict``, 1 when any site is covered by nothing or an adapter site
was not found in the source (the release changed under us).
"""

from __future__ import annotations

import argparse
import json as jsonlib
import sys
from typing import Any


def report() -> dict[str, Any]:
    from .flashinfer_sites import coverage_report

    return coverage_report()


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render(report: dict[str, Any], json: bool = False) -> str:
    """The report as an operator reads it (a short table), or as JSON."""
    if json:
        return jsonlib.dumps(report, indent=1, sort_keys=True)
    if not report.get("flashinfer"):
        return "flashinfer is not installed: nothing to cover."
    summary = report.get("summary", {})
    lines = [
        f"flashinfer       {report['flashinfer']}  ({report.get('flashinfer_dir')})",
        f"  generation     {report.get('generation')}{'' if report.get('verified') else '  [not a tested version]'}",
        f"cute-diskcache   {report.get('cute_diskcache')}",
        f"DSL              {report.get('dsl')}",
        f"torch            {report.get('torch')}",
        f"cache root       {report.get('root')}  ({report.get('root_source')})",
        f"  enabled        {_yes(bool(report.get('enabled')))} (FLASHINFER_B12X_DISK_CACHE)"
        f"   read-only {_yes(bool(report.get('readonly')))}",
        f"target profile   {report.get('target') or 'none (the real device)'}"
        + (f"  arch {report['arch']}" if report.get("arch") else ""),
    ]
    if report.get("native_cache_dir"):
        state = "OFF (FLASHINFER_CUTE_DSL_DISABLE_CACHE=1)" if report.get("native_cache_disabled") else "on"
        lines.append(f"flashinfer cache {report['native_cache_dir']}  ({state})")
    if report.get("native_sites"):
        lines.append(f"  native sites   served by {report['native_sites']} (CUTE_DISKCACHE_NATIVE_SITES)")
    sites = report.get("sites", [])
    lines += [
        "",
        f"compile sites: {len(sites)}  "
        + "  ".join(f"{name} {summary.get(name, 0)}" for name in ("cute-diskcache", "flashinfer", "nothing")),
    ]
    if sites:
        width = max(len(f"{s['file']}:{s['function']}") for s in sites)
        lines.append(f"  {'persisted by':<15}{'site':<{width}}  how")
        for s in sites:
            how = ", ".join(s.get("calls", []))
            if s.get("note"):
                how += f"  ({s['note']})"
            lines.append(f"  {s['status']:<15}{s['file'] + ':' + s['function']:<{width}}  {how}")
    missing = report.get("missing_adapter_sites") or []
    if missing:
        lines += ["", "adapter sites not found in this flashinfer's source (renamed or reworked upstream):"]
        lines += [f"  {m}" for m in missing]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cute-diskcache doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any site is covered by nothing")
    args = ap.parse_args(argv)
    rep = report()
    print(render(rep, json=args.json))
    if args.strict and (rep.get("summary", {}).get("nothing") or rep.get("missing_adapter_sites")):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
