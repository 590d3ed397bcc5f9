"""Which sm12x MoE compile sites of the installed flashinfer are persisted, and by whom.

The source text is the ground truth, not our tables: every module under
``fused_moe/cute_dsl/blackwell_sm12x`` (and ``b12x_moe.py``) is parsed, and every CuTe-DSL
compile call found is classified as covered by cute-diskcache, by flashinfer's native cache,
or by nothing. A new flashinfer release that adds a site therefore shows up as "nothing"
instead of being silently missed. Nothing here imports flashinfer.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import compat, v0_6, v0_7
from ._common import flashinfer_version

COVERED_BY_US, NATIVE, NOTHING = "cute-diskcache", "flashinfer", "nothing"
NATIVE_BUILDER = "build_and_load_cute_dsl_kernel"
SCANNED = ("fused_moe/cute_dsl/blackwell_sm12x", "fused_moe/cute_dsl/b12x_moe.py")


@dataclass
class Found:
    """One function that compiles: where, how, and (after :func:`classify`) who persists it."""

    file: str  # relative to blackwell_sm12x/ (b12x_moe.py: "../b12x_moe.py")
    function: str  # qualified name inside the file
    line: int
    calls: list[str] = field(default_factory=list)  # "cute.compile", "cute.compile[...]", ...
    native: bool = False  # the compile runs inside build_and_load_cute_dsl_kernel
    via: str | None = None  # a flashinfer compile wrapper this function calls
    status: str = NOTHING
    note: str = ""


class _Scanner(ast.NodeVisitor):
    """Finds compile calls in one module, attributed to their enclosing function."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.stack: list[str] = []
        self.cute_names = {"cute"}
        self.wrappers: dict[str, str] = {}  # local name -> "module.compile"
        self.native_names = {NATIVE_BUILDER}
        self.found: dict[str, Found] = {}
        self._native_depth = 0

    # -- bindings ---------------------------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "cutlass.cute" and alias.asname:
                self.cute_names.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            local = alias.asname or alias.name
            if module == "cutlass" and alias.name == "cute":
                self.cute_names.add(local)
            elif alias.name == NATIVE_BUILDER:
                self.native_names.add(local)
            elif alias.name == "compile" and (node.level > 0 or module.startswith("flashinfer")):
                # A flashinfer compile wrapper imported by name (moe_w4a16_compiler.compile).
                self.wrappers[local] = f"{module.rsplit('.', 1)[-1]}.compile"

    # -- scopes -----------------------------------------------------------------------------

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.stack.append(name)
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    # -- hits -------------------------------------------------------------------------------

    def _hit(self, node: ast.AST, what: str, *, native: bool = False, via: str | None = None) -> None:
        function = ".".join(self.stack) or "<module>"
        f = self.found.setdefault(function, Found(self.file, function, getattr(node, "lineno", 0)))
        if what not in f.calls:
            f.calls.append(what)
        f.native = f.native or native
        f.via = f.via or via

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in self.native_names:
            self._hit(node, NATIVE_BUILDER, native=True)
            self._native_depth += 1
            self.generic_visit(node)
            self._native_depth -= 1
            return
        if isinstance(func, ast.Name) and func.id in self.wrappers:
            self._hit(node, f"{self.wrappers[func.id]}(...)", via=self.wrappers[func.id])
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if self._is_cute_compile(node.value):
            self._hit(node, "cute.compile[...]", native=self._native_depth > 0)
            self.visit(node.slice)
            return
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._is_cute_compile(node):
            self._hit(node, "cute.compile", native=self._native_depth > 0)
        self.generic_visit(node)

    def _is_cute_compile(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "compile" and isinstance(node.value, ast.Name) \
            and node.value.id in self.cute_names


def scan(package_dir: Path) -> list[Found]:
    """Every compiling function under ``package_dir`` (flashinfer's package directory)."""
    base = package_dir / SCANNED[0]
    files = sorted(base.rglob("*.py")) + [package_dir / SCANNED[1]]
    out: list[Found] = []
    for path in files:
        if not path.is_file():
            continue
        rel = os.path.relpath(path, base)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, OSError) as exc:
            out.append(Found(rel, "<unparsable>", 0, note=f"{type(exc).__name__}: {exc}"))
            continue
        scanner = _Scanner(rel)
        scanner.visit(tree)
        out.extend(sorted(scanner.found.values(), key=lambda f: f.line))
    return out


def _table(version: str, native_ours: bool) -> dict[tuple[str, str], str]:
    """(file, function) -> kind of the sites cute-diskcache serves for ``version``."""
    if v0_6.applies(version):
        return v0_6.COVERED
    if v0_7.applies(version):
        return {**v0_7.COVERED, **(v0_7.NATIVE_COVERED if native_ours else {})}
    return {}


def _shapes(version: str, native_ours: bool) -> dict[str, dict[str, compat.SiteShape]]:
    """module -> function -> what the adapter relies on, for the sites serving ``version``."""
    if v0_6.applies(version):
        return v0_6.SHAPES
    if v0_7.applies(version):
        return {**v0_7.SHAPES, **(v0_7.NATIVE_SHAPES if native_ours else {})}
    return {}


def classify(found: list[Found], version: str, *, native_disabled: bool = False, native_ours: bool = False,
             site_checks: dict[str, list[str]] | None = None) -> list[Found]:
    """Set each site's status for flashinfer ``version``.

    Covered by us: a (file, function) in the adapter table of the generation serving that
    version (with ``native_ours``, flashinfer's natively cached moe_dispatch sites too), or a
    call through a wrapper we cover. Native: the compile runs inside
    ``build_and_load_cute_dsl_kernel`` (unless ``FLASHINFER_CUTE_DSL_DISABLE_CACHE=1`` turns
    that cache off). Everything else: nothing. On a release outside the verified list, an adapter
    site whose ``site_checks`` found problems is passed through, so it is nothing's too.
    """
    table = _table(version, native_ours)
    unverified = site_checks is not None and not compat.verified(version)

    def problems(file: str, function: str) -> list[str]:
        return (site_checks or {}).get(f"{file}:{function}") or [] if unverified else []

    wrapped = {f"{file[:-3]}.{fn}" for file, fn in table if not problems(file, fn)}
    for f in found:
        passed_through = problems(f.file, f.function) if (f.file, f.function) in table else []
        if (f.file, f.function) in table and not passed_through:
            f.status = COVERED_BY_US
            if f.native:
                f.note = "flashinfer's native site, served from cute-diskcache (CUTE_DISKCACHE_NATIVE_SITES=flashinfer leaves it to flashinfer)"
            if unverified:
                f.note = "unverified release, checks passed" + (f"; {f.note}" if f.note else "")
        elif f.native:
            f.status = NOTHING if native_disabled else NATIVE
            if native_disabled:
                f.note = "flashinfer's native cache is off (FLASHINFER_CUTE_DSL_DISABLE_CACHE=1)"
        elif f.via is not None and f.via in wrapped:
            f.status, f.note = COVERED_BY_US, f"through {f.via}"
        else:
            f.status = NOTHING
        if passed_through:
            f.note = "unverified release, passed through uncached: " + "; ".join(passed_through) + (f"; {f.note}" if f.note else "")
    return found


def flashinfer_dir() -> Path | None:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def generation_name(version: str) -> str:
    if v0_6.applies(version):
        return "0.6.12-0.6.17: moe_dispatch sites, no native cache"
    if v0_7.applies(version):
        if v0_7.serves_native():
            return "0.6.18+: cute-diskcache for every site, static/micro/dynamic instead of flashinfer's native cache"
        return "0.6.18+: native cache for static/micro/dynamic (CUTE_DISKCACHE_NATIVE_SITES=flashinfer); cute-diskcache for the rest"
    return f"unsupported (cute-diskcache covers flashinfer {'.'.join(map(str, v0_6.FIRST_SUPPORTED))}+)"


def sites_report(package_dir: Path | None = None, version: str | None = None) -> dict[str, Any]:
    """The site table: scanned, classified, plus adapter sites the source no longer has."""
    package_dir = package_dir or flashinfer_dir()
    version = version or flashinfer_version()
    if package_dir is None:
        return {"flashinfer": None, "sites": [], "summary": {}, "missing_adapter_sites": []}
    native_disabled = os.environ.get("FLASHINFER_CUTE_DSL_DISABLE_CACHE", "0") == "1"
    native_ours = v0_7.applies(version) and v0_7.serves_native()
    checked = compat.report(package_dir, version, _shapes(version, native_ours))
    found = classify(scan(package_dir), version, native_disabled=native_disabled, native_ours=native_ours,
                     site_checks=checked["site_checks"])
    table = _table(version, native_ours)
    present = {(f.file, f.function) for f in found}
    base = package_dir / SCANNED[0]
    files = {os.path.relpath(p, base) for p in base.rglob("*.py")}
    summary = {s: sum(1 for f in found if f.status == s) for s in (COVERED_BY_US, NATIVE, NOTHING)}
    return {
        "flashinfer": version,
        "flashinfer_dir": str(package_dir),
        "generation": generation_name(version),
        "verified": checked["verified"],
        "verified_releases": checked["verified_releases"],
        "refused": checked["refused"],
        "refused_evidence": checked["refused_evidence"],
        "site_checks": checked["site_checks"],
        "native_cache_disabled": native_disabled,
        "native_sites": ("cute-diskcache" if native_ours else "flashinfer") if v0_7.applies(version) else None,
        "sites": [asdict(f) for f in found],
        "summary": summary,
        # Adapter sites whose file exists but no longer compiles in that function: renamed
        # or reworked upstream (a file the release does not have yet is not listed).
        "missing_adapter_sites": sorted(f"{file}:{fn}" for file, fn in table if file in files and (file, fn) not in present),
    }


def coverage_report() -> dict[str, Any]:
    """The doctor's view: installed versions, active settings, and the classified site table."""
    import importlib.metadata

    from .. import _version, config, targets
    from ..key import dsl_stack_string

    def version_of(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    report = sites_report()
    settings = config.load()
    profile = targets.active()
    target = profile.name if profile else settings.target
    try:
        arch = os.environ.get("CUTE_DSL_ARCH") or (targets.get(target).arch if target else None)
    except targets.UnknownProfileError:
        arch = None
    try:
        dsl = dsl_stack_string()
    except Exception as exc:  # the doctor must work with a broken DSL install
        dsl = f"unavailable: {exc}"
    report.update(
        cute_diskcache=_version.__version__,
        torch=version_of("torch"),
        dsl=dsl,
        root=str(settings.root),
        root_source=settings.root_source,
        enabled=settings.enabled,
        readonly=settings.readonly,
        target=target,
        arch=arch,
        native_cache_dir=_native_cache_dir(report.get("flashinfer")),
    )
    return report


def _native_cache_dir(version: str | None) -> str | None:
    """Where flashinfer >= 0.6.18 keeps its own kernels (``<archs>`` is decided at its import)."""
    if version is None or not v0_7.applies(version):
        return None
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(Path.home())
    return str(Path(base) / ".cache" / "flashinfer" / version / "<archs>" / "cached_ops")
