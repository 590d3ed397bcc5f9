"""``cute-diskcache doctor``: is every sm12x compile site of this flashinfer (and of b12x, SGLang) persisted?

Reads all of the installed flashinfer's source (never imports it) and prints, for every
CuTe-DSL compile site that can build an sm12x kernel (``cute.compile``, ``cute.compile[...]``,
flashinfer's ``build_and_load_cute_dsl_kernel``, ``_compile_block_scaled_gemm`` and compile
functions imported by name), whether cute-diskcache covers it, flashinfer's own disk cache does,
or nothing does; plus the versions, the cache root and the target profile in effect. Sites of
any arch (kernels with no arch in their name or code, built for whatever card runs them), of
other archs only, and test or benchmark code shipped in the wheel are counted apart
(``--all`` lists them). A site a new release adds shows up as "nothing" rather than compiling
silently on every start.

On a release outside the verified list (the compatibility matrix, ``compat/README.md``) it says
so; its sites are served all the same (keyed by what they compile), and one that moved where the
site table does not look shows as "nothing". A flashinfer + DSL combination the matrix shows
cannot work is reported as refused.

Exit status: 0; with ``--strict``, 1 when any sm12x site is covered by nothing, an adapter site
was not found in the source (the release changed under us), or the combination is refused.
"""

from __future__ import annotations

import argparse
import json as jsonlib
import sys
from typing import Any


def report() -> dict[str, Any]:
    from ..b12x_sites import scan as b12x_scan
    from ..flashinfer_sites import coverage_report
    from ..sglang_sites import scan as sglang_scan
    from ..vllm_sites import scan as vllm_scan

    return {**coverage_report(), "b12x": b12x_scan.report(), "sglang": sglang_scan.report(), "vllm": vllm_scan.report(),
            "host_code": host_code_report()}


def host_code_report() -> dict[str, Any]:
    """What host code new entries get, and whether this CPU runs it (a pre-2009 CPU would not)."""
    from ..keys import hostcpu

    code = hostcpu.host_code()
    return {"name": code.name, "machine": code.machine, "setting": hostcpu.env_name(),
            "this_cpu_lacks": hostcpu.missing(code.extensions, machine=code.machine)}


def _host_code_line(report: dict[str, Any]) -> str:
    code = report.get("host_code") or {}
    if not code:
        return ""
    lacks = code.get("this_cpu_lacks") or []
    runs = f"this CPU lacks {', '.join(lacks)}" if lacks else "this CPU runs it"
    return f"host code        {code['name']} for new entries ({code['setting']}); {runs}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


#: The groups counted apart from the sm12x sites, as the doctor titles them.
_GROUPS = (
    ("any", "any-arch sites (no arch in their code: built for whatever card runs them, SM120 included)"),
    ("other", "other-arch sites (never built for sm12x)"),
    ("harness", "test and benchmark code shipped in the wheel (no engine reaches it)"),
)


def _group(site: dict[str, Any]) -> str:
    return "harness" if site.get("harness") else str(site.get("arch", "sm12x"))


def _table(sites: list[dict[str, Any]]) -> list[str]:
    if not sites:
        return []
    name = lambda s: f"{s.get('path') or s['file']}:{s['function']}"  # noqa: E731 - a one-line formatter, read where it is used
    width = max(len(name(s)) for s in sites)
    lines = [f"  {'persisted by':<15}{'site':<{width}}  how"]
    for s in sites:
        how = ", ".join(s.get("calls", []))
        if s.get("note"):
            how += f"  ({s['note']})"
        lines.append(f"  {s['status']:<15}{name(s):<{width}}  {how}")
    return lines


def render(report: dict[str, Any], json: bool = False, show_all: bool = False) -> str:
    """The report as an operator reads it (the sm12x table, the other groups counted), or as JSON."""
    if json:  # "schema": the version of the CLI's JSON documents (cli.output.SCHEMA)
        return jsonlib.dumps({"schema": 1, **report}, indent=1, sort_keys=True)
    if not report.get("flashinfer"):
        return "\n".join(["flashinfer is not installed: nothing to cover.", *_b12x_lines(report, show_all)])
    summary = report.get("summary", {})
    lines = [
        f"flashinfer       {report['flashinfer']}  ({report.get('flashinfer_dir')})",
        f"  generation     {report.get('generation')}",
        f"  release        {_release_line(report)}",
        f"cute-diskcache   {report.get('cute_diskcache')}",
        f"DSL              {report.get('dsl')}",
        f"torch            {report.get('torch')}",
        f"cache root       {report.get('root')}  ({report.get('root_source')})",
        f"  enabled        {_enabled_text(bool(report.get('enabled')))}   read-only {_yes(bool(report.get('readonly')))}",
        f"target profile   {report.get('target') or 'none (the real device)'}"
        + (f"  arch {report['arch']}" if report.get("arch") else ""),
        _host_code_line(report),
    ]
    if report.get("native_cache_dir"):
        state = "OFF (FLASHINFER_CUTE_DSL_DISABLE_CACHE=1)" if report.get("native_cache_disabled") else "on"
        lines.append(f"flashinfer cache {report['native_cache_dir']}  ({state})")
    if report.get("native_sites"):
        lines.append(f"  native sites   served by {report['native_sites']} (CUTE_DISKCACHE_NATIVE_SITES)")
    sites = report.get("sites", [])
    sm12x = [s for s in sites if _group(s) == "sm12x"]
    lines += [
        "",
        f"sm12x compile sites: {len(sm12x)}  "
        + "  ".join(f"{name} {summary.get(name, 0)}" for name in ("cute-diskcache", "flashinfer", "nothing")),
    ]
    lines += _table(sm12x)
    groups = report.get("groups") or {}
    for name, title in _GROUPS:
        counts = groups.get(name) or {}
        members = [s for s in sites if _group(s) == name]
        if not members:
            continue
        lines += ["", f"{title}: {len(members)}  " + "  ".join(f"{k} {v}" for k, v in counts.items() if v)]
        if show_all:
            lines += _table(members)
    if not show_all and len(sm12x) < len(sites):
        lines.append("  (--all lists every site; --json has them all)")
    if report.get("refused"):
        lines += ["", f"REFUSED: {report['refused']}", "  cute-diskcache attaches nothing in this environment; flashinfer runs uncached."]
    missing = report.get("missing_adapter_sites") or []
    if missing:
        lines += ["", "adapter sites not found in this flashinfer's source (renamed or reworked upstream):"]
        lines += [f"  {m}" for m in missing]
    return "\n".join([*lines, *_b12x_lines(report, show_all)])


def _b12x_lines(report: dict[str, Any], show_all: bool) -> list[str]:
    """The b12x block (:mod:`..b12x_sites.scan`), after a blank line; none in a report without it."""
    if "b12x" not in report:
        return []
    from ..b12x_sites import scan as b12x_scan

    lines = ["", *b12x_scan.render(report["b12x"], show_all)]
    if report.get("sglang") is not None:  # SGLang's block (:mod:`..sglang_sites.scan`)
        from ..sglang_sites import scan as sglang_scan

        lines += ["", *sglang_scan.render(report["sglang"], show_all)]
    if report.get("vllm") is not None:  # vLLM's own block (:mod:`..vllm_sites.scan`)
        from ..vllm_sites import scan as vllm_scan

        lines += ["", *vllm_scan.render(report["vllm"], show_all)]
    return lines


def _enabled_text(enabled: bool) -> str:
    """Whether this environment serves from the cache; prewarm and doctor work either way."""
    if enabled:
        return "yes (FLASHINFER_B12X_DISK_CACHE=1)"
    return "no in this shell (prewarm and doctor do not need it); set FLASHINFER_B12X_DISK_CACHE=1 where the engine runs"


def _release_line(report: dict[str, Any]) -> str:
    if report.get("verified"):
        return "verified (compatibility matrix: every covered site compiled, then hit with 0 compiles)"
    return (f"NOT verified (verified: {', '.join(report.get('verified_releases') or [])}); its sites are served "
            "all the same, keyed by what they compile (the site table below says which ones it reaches)")


def strict_failure(report: dict[str, Any]) -> bool:
    """What ``--strict`` fails on: an sm12x site nothing persists, a vanished adapter site, a refusal
    (flashinfer's or b12x's)."""
    from ..sglang_sites import scan as sglang_scan
    from ..vllm_sites import scan as vllm_scan

    b12x = report.get("b12x") or {}
    return bool(report.get("summary", {}).get("nothing") or report.get("missing_adapter_sites") or report.get("refused")
                or b12x.get("summary", {}).get("nothing") or b12x.get("missing_adapter_sites")
                or sglang_scan.strict_failure(report.get("sglang") or {}) or vllm_scan.strict_failure(report.get("vllm") or {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cute-diskcache doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any sm12x site is covered by nothing")
    ap.add_argument("--all", action="store_true", help="list every site, not only the sm12x ones")
    args = ap.parse_args(argv)
    rep = report()
    print(render(rep, json=args.json, show_all=args.all))
    if args.strict and strict_failure(rep):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
