"""Which CuTe-DSL compile sites of the installed flashinfer are persisted, and by whom.

The source text is the ground truth, not our tables: every module of the installed flashinfer
is read, every CuTe-DSL compile call in it (``cute.compile``, ``cute.compile[...]``, and
flashinfer's own wrappers: ``build_and_load_cute_dsl_kernel``, ``_compile_block_scaled_gemm``,
compile functions imported by name) is attributed to its function, and each site is classified:

* **who persists it**: cute-diskcache (an adapter table of ours), flashinfer (its native disk
  cache, or another cache of its own), nothing; flashinfer's shared compile helpers are
  "per caller" (each caller is a site of its own);
* **which arch** it builds for (:mod:`.known`): sm12x, any arch, or other archs only; test and
  benchmark code shipped in the wheel is set apart.

A new flashinfer release that adds a site therefore shows up as "nothing" instead of being
silently missed. Nothing here imports flashinfer. Fast: the package is 3,500 files (125 MB) in
0.7.4, so files are filtered by their bytes first, files under another arch's tree are counted
rather than parsed, and a file is parsed only in the top-level blocks that compile (and its
imports), or whole if a block does not parse on its own.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import compat, known, sites
from ._common import flashinfer_version, version_tuple
from .names import MOE_BASE, package_path, table_name  # noqa: F401  (MOE_BASE, table_name: imported from here by others)

COVERED_BY_US, NATIVE, NOTHING, PER_CALLER = "cute-diskcache", "flashinfer", "nothing", "per caller"
STATUSES = (COVERED_BY_US, NATIVE, NOTHING, PER_CALLER)
NATIVE_BUILDER = "build_and_load_cute_dsl_kernel"
GEMM_HELPER = "_compile_block_scaled_gemm"
#: What a top-level block with a compile site contains (a file must contain "compile" first).
_COMPILE_TEXT = (".compile", "compile(", "compile[", "build_and_load_cute_dsl_kernel", "_compile_block_scaled_gemm")
#: A line that starts with a string literal (the rest of a multi-line string) never starts a block.
_STRING_START = re.compile(r"[rbfuRBFU]{0,2}[\"']")
#: What an other-arch file is counted by (it is not parsed).
_COUNTED = re.compile(r"cute\.compile\b|build_and_load_cute_dsl_kernel")


@dataclass
class Found:
    """One function that compiles: where, how, and (after :func:`classify`) who persists it."""

    file: str  # the adapter tables' name: relative to blackwell_sm12x/ inside it ("../b12x_moe.py"), else = path
    function: str  # qualified name inside the file ("<file>": an other-arch file, counted whole)
    line: int
    calls: list[str] = field(default_factory=list)  # "cute.compile", "cute.compile[...]", ...
    native: bool = False  # the compile runs inside build_and_load_cute_dsl_kernel (or its equivalent)
    via: str | None = None  # "file:function" of a flashinfer compile function this one calls
    status: str = NOTHING
    note: str = ""
    arch: str = known.ANY_ARCH  # sm12x | any | other
    arch_reason: str = ""  # what decided it: "path", "code", "no arch named"
    harness: bool = False  # test, benchmark or reference code shipped in the wheel
    path: str = ""  # relative to flashinfer's package directory

    def __post_init__(self) -> None:
        if not self.path:  # made from a package-relative name: derive the tables' name
            self.path = self.file
            self.file = table_name(self.file)


def _module_path(file: str, module: str, level: int) -> str | None:
    """The package-relative file an import names (``from ..x import y`` in ``file``), or None."""
    if level == 0:
        if not module.startswith("flashinfer."):
            return None
        parts = module.split(".")[1:]
    else:
        base = file.split("/")[:-1]
        if level - 1 > len(base):
            return None
        parts = base[:len(base) - (level - 1)] + (module.split(".") if module else [])
    return "/".join(parts) + ".py"


class _Scanner(ast.NodeVisitor):
    """Finds compile calls in one module, attributed to their enclosing function."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.stack: list[str] = []
        self.cute_names = {"cute"}
        self.wrappers: dict[str, str] = {}  # local name -> "file:compile" of a flashinfer compile function
        self.native_names = {NATIVE_BUILDER}
        self.found: dict[str, Found] = {}
        self.words: dict[str, set[str]] = {}  # top-level block -> the words its code uses
        self.refs: dict[str, list[bool]] = {}  # name -> for each load of it: inside a native builder call?
        self.line_offset = 0  # the first line of the block being visited, minus one
        self._native_depth = 0

    # -- bindings ---------------------------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._word(alias.name)
            if alias.name == "cutlass.cute" and alias.asname:
                self.cute_names.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        self._word(module)
        for alias in node.names:
            local = alias.asname or alias.name
            self._word(alias.name)
            if module == "cutlass" and alias.name == "cute":
                self.cute_names.add(local)
            elif alias.name == NATIVE_BUILDER:
                self.native_names.add(local)
            elif alias.name == "compile" and (node.level > 0 or module.startswith("flashinfer")):
                # A flashinfer compile wrapper imported by name (moe_w4a16_compiler.compile).
                path = _module_path(self.file, module, node.level)
                self.wrappers[local] = f"{path or module}:compile"

    # -- scopes and words -------------------------------------------------------------------

    def _word(self, word: str) -> None:
        self.words.setdefault(self.stack[0] if self.stack else "<module>", set()).add(word)

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.stack.append(node.name)
        self._word(node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # a docstring says nothing about the code's arch
        for child in [*node.decorator_list, *getattr(node, "bases", []), *body]:
            self.visit(child)
        if not isinstance(node, ast.ClassDef):
            self.visit(node.args)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped  # type: ignore[assignment]

    def visit_Name(self, node: ast.Name) -> None:
        self._word(node.id)
        if isinstance(node.ctx, ast.Load):
            self.refs.setdefault(node.id, []).append(self._native_depth > 0)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and len(node.value) < 200:
            self._word(node.value)

    # -- hits -------------------------------------------------------------------------------

    def _hit(self, node: ast.AST, what: str, *, native: bool = False, via: str | None = None) -> None:
        function = ".".join(self.stack) or "<module>"
        f = self.found.setdefault(function, Found(self.file, function, getattr(node, "lineno", 0) + self.line_offset))
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
        if name == GEMM_HELPER and self.stack and self.stack[-1] != GEMM_HELPER:
            # flashinfer persists the helper's kernel itself when given a cache_module_name.
            persisted = any(k.arg == "cache_module_name" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
                            for k in node.keywords)
            self._hit(node, f"{GEMM_HELPER}(...)" + (" with cache_module_name" if persisted else ""), native=persisted)
        if isinstance(func, ast.Name) and func.id in self.wrappers:
            self._hit(node, f"{self.wrappers[func.id].split(':')[0].rsplit('/', 1)[-1][:-3]}.compile(...)", via=self.wrappers[func.id])
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if self._is_cute_compile(node.value):
            self._hit(node, "cute.compile[...]", native=self._native_depth > 0)
            self.visit(node.slice)
            return
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._word(node.attr)
        if self._is_cute_compile(node):
            self._hit(node, "cute.compile", native=self._native_depth > 0)
        self.generic_visit(node)

    def _is_cute_compile(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "compile" and isinstance(node.value, ast.Name) \
            and node.value.id in self.cute_names

    # -- after the visit --------------------------------------------------------------------

    def sites(self, text: str) -> list[Found]:
        """The sites found, each with its block's words' arch; a function compiled only inside
        native builder calls of this file (``lambda: _compile_x(...)``) counts as native."""
        out = []
        for f in sorted(self.found.values(), key=lambda f: f.line):
            simple = f.function.rsplit(".", 1)[-1]
            refs = self.refs.get(simple, [])
            if not f.native and refs and all(refs) \
                    and len(re.findall(rf"\b{re.escape(simple)}\b", text)) == len(refs) + 1:
                f.native, f.note = True, "compiled only inside flashinfer's disk-cache builder"
            f.arch, f.arch_reason = known.site_arch(f.path, self.words.get(f.function.split(".", 1)[0], set()))
            f.harness = known.harness(f.path, f.function)
            out.append(f)
        return out


def _units(text: str) -> list[tuple[int, ast.Module]]:
    """What to parse of one file, as (first line - 1, tree): its imports and compiling blocks.

    A top-level block runs from a line that starts at column 0 (decorators joined to their
    definition; closing brackets, ``else``/``except`` and string text continue a block) to the
    next one. A ``def`` at column 0 inside a multi-line string starts a block that holds the
    string's closing quotes without the opening ones: it does not parse on its own, raises
    SyntaxError, and the caller parses the whole file instead.
    """
    lines = text.splitlines(keepends=True)
    heads = [i for i, line in enumerate(lines)
             if line[:1] not in ("", " ", "\t", "#", "\n", "\r", ")", "]", "}")
             and not line.startswith(("else", "elif", "except", "finally")) and not _STRING_START.match(line)]
    starts = [h for n, h in enumerate(heads) if n == 0 or not lines[heads[n - 1]].startswith("@")]
    units = []
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        chunk = "".join(lines[start:end])
        if lines[start].startswith(("import ", "from ")) or ("compile" in chunk and any(t in chunk for t in _COMPILE_TEXT)):
            units.append((start, ast.parse(chunk)))
    return units


def _scan_file(path: Path, rel: str, data: bytes) -> list[Found]:
    text = data.decode("utf-8")
    if known.path_arch(rel) == known.OTHER_ARCH and not known.names_sm12x(data):
        count = len(_COUNTED.findall(text))  # another arch's tree: counted, not parsed
        if not count:
            return []
        found = Found(rel, "<file>", 0, [f"{count} compile call{'s' * (count != 1)}"], arch=known.OTHER_ARCH,
                      arch_reason="path", harness=known.harness(rel, ""))
        return [found]
    try:
        units = _units(text)
    except SyntaxError:
        units = [(0, ast.parse(text, filename=str(path)))]
    scanner = _Scanner(rel)
    for offset, unit in units:
        scanner.line_offset = offset
        scanner.visit(unit)
    return scanner.sites(text)


def scan(package_dir: Path) -> list[Found]:
    """Every compiling function under ``package_dir`` (flashinfer's package directory)."""
    out: list[Found] = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).as_posix()
        try:
            data = path.read_bytes()
            if b"compile" not in data or (b"cute" not in data and b"build_and_load" not in data and b"_compile_block" not in data):
                continue
            out.extend(_scan_file(path, rel, data))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError, RecursionError) as exc:
            out.append(Found(rel, "<unparsable>", 0, note=f"{type(exc).__name__}: {exc}", arch=known.path_arch(rel) or known.ANY_ARCH))
    return out


#: The first release we cover, and the first that caches moe_dispatch's kernels itself.
FIRST_SUPPORTED, FIRST_NATIVE = (0, 6, 12), (0, 6, 18)


def _supported(version: str) -> bool:
    return version_tuple(version)[:3] >= FIRST_SUPPORTED


def _native_release(version: str) -> bool:
    return version_tuple(version)[:3] >= FIRST_NATIVE


def _table(version: str, native_ours: bool, package_dir: Path | None) -> dict[tuple[str, str], str]:
    """(file as the scan names it, function) -> kind of the sites we serve for ``version``."""
    if not _supported(version) or package_dir is None:
        return {}
    return sites.covered(package_dir, native=native_ours)


def classify(found: list[Found], version: str, *, package_dir: Path | None = None, native_disabled: bool = False,
             native_ours: bool = False) -> list[Found]:
    """Set each site's status for flashinfer ``version``.

    Covered by us: a (file, function) in the adapter tables serving that version (with
    ``native_ours``, flashinfer's natively cached sm12x sites too), or a call through a wrapper we
    cover. Per caller: one of flashinfer's shared compile helpers (:data:`.known.HELPERS`).
    flashinfer: a cache of its own (:data:`.known.OWN_CACHES`), or the compile runs inside
    ``build_and_load_cute_dsl_kernel`` (unless ``FLASHINFER_CUTE_DSL_DISABLE_CACHE=1`` turns that
    cache off). Everything else: nothing.
    """
    table = _table(version, native_ours, package_dir)
    wrapped = {f"{package_path(file)}:{fn}" for file, fn in table}
    own = {f"{file}:{fn}": why for (file, fn), why in known.OWN_CACHES.items()}
    for f in found:
        where = (f.file, f.function)
        if where in table:
            f.status = COVERED_BY_US
            if f.native:
                f.note = "flashinfer's native site, served from cute-diskcache (CUTE_DISKCACHE_NATIVE_SITES=flashinfer leaves it to flashinfer)"
            else:
                f.note = sites.NOTE
        elif where in known.HELPERS:
            f.status, f.note = PER_CALLER, known.HELPERS[where]
        elif where in known.OWN_CACHES or (f.via is not None and f.via in own):
            f.status, f.note = NATIVE, known.OWN_CACHES.get(where) or f"through {f.via}: {own[f.via or '']}"
        elif f.native:
            f.status = NOTHING if native_disabled else NATIVE
            if native_disabled:
                f.note = "flashinfer's native cache is off (FLASHINFER_CUTE_DSL_DISABLE_CACHE=1)"
            elif where in known.NOT_SERVED:
                f.note = f"flashinfer's native cache (keyed with torch's build); not served from ours: {known.NOT_SERVED[where]}"
        elif f.via is not None and f.via in wrapped:
            f.status, f.note = COVERED_BY_US, f"through {f.via}"
        else:
            f.status = NOTHING
    status = {(f.file, f.function): f for f in found}
    for f in found:
        target = known.compiled_through(f.path, f.function)
        if target is not None and target in status:
            f.status, f.note = status[target].status, f"compiled only through {target[0]}:{target[1]}"
            if f.status == COVERED_BY_US and f.arch != known.SM12X_ARCH:  # we serve that site's sm12x calls only
                f.status, f.note = NATIVE, f.note + " (flashinfer's native cache for archs other than sm12x)"
    return found


def group(f: Found | dict[str, Any]) -> str:
    """The report group of a site: ``sm12x``, ``any``, ``other``, or ``harness`` (test code)."""
    d = f if isinstance(f, dict) else asdict(f)
    return "harness" if d["harness"] else d["arch"]


def summarize(found: list[Found]) -> dict[str, dict[str, int]]:
    """group -> status -> sites."""
    out: dict[str, dict[str, int]] = {g: {s: 0 for s in STATUSES} for g in (known.SM12X_ARCH, known.ANY_ARCH, known.OTHER_ARCH, "harness")}
    for f in found:
        out[group(f)][f.status] += 1
    return out


def flashinfer_dir() -> Path | None:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def generation_name(version: str) -> str:
    from .native import serves_native

    if not _supported(version):
        return f"unsupported (cute-diskcache covers flashinfer {'.'.join(map(str, FIRST_SUPPORTED))}+)"
    if not _native_release(version):
        return "0.6.12-0.6.17: every covered site through the compile hook, no native cache"
    if serves_native():
        return "0.6.18+: cute-diskcache for every covered site, flashinfer's natively cached sm12x kernels included"
    return "0.6.18+: flashinfer's native cache for its natively cached sm12x kernels (CUTE_DISKCACHE_NATIVE_SITES=flashinfer); cute-diskcache for the rest"


def sites_report(package_dir: Path | None = None, version: str | None = None) -> dict[str, Any]:
    """The site table: scanned, classified, plus adapter sites the source no longer has.

    ``summary`` counts the sm12x sites an engine can reach (what ``doctor --strict`` judges);
    ``groups`` counts every group (sm12x, any arch, other archs, test code) by status.
    """
    package_dir = package_dir or flashinfer_dir()
    version = version or flashinfer_version()
    if package_dir is None:
        return {"flashinfer": None, "sites": [], "summary": {}, "groups": {}, "missing_adapter_sites": []}
    native_disabled = os.environ.get("FLASHINFER_CUTE_DSL_DISABLE_CACHE", "0") == "1"
    from .native import serves_native

    native_ours = _native_release(version) and serves_native()
    checked = compat.report(version)
    found = classify(scan(package_dir), version, package_dir=package_dir, native_disabled=native_disabled, native_ours=native_ours)
    table = _table(version, native_ours, package_dir)
    present = {(f.file, f.function) for f in found}
    groups = summarize(found)
    summary = {s: groups[known.SM12X_ARCH][s] for s in (COVERED_BY_US, NATIVE, NOTHING)}
    return {
        "flashinfer": version,
        "flashinfer_dir": str(package_dir),
        "generation": generation_name(version),
        "verified": checked["verified"],
        "verified_releases": checked["verified_releases"],
        "refused": checked["refused"],
        "refused_evidence": checked["refused_evidence"],
        "native_cache_disabled": native_disabled,
        "native_sites": ("cute-diskcache" if native_ours else "flashinfer") if _native_release(version) else None,
        "sites": [asdict(f) for f in found],
        "summary": summary,
        "groups": groups,
        # Sites the release defines that neither compile nor call anything that could: reworked
        # upstream, so the hook would no longer meet a compile under them.
        "missing_adapter_sites": sorted(f"{file}:{fn}" for file, fn in table
                                        if (file, fn) not in present and not _delegates(package_dir, file, fn)),
    }


def _delegates(package_dir: Path, file: str, function: str) -> bool:
    """Whether ``function`` calls a function of flashinfer's (not a builtin): a compile there is
    met by the hook under it (:data:`.sites.DEPTH`), and one the site table does not cover shows
    up in the scan as "nothing" (0.7.0's Sage BSA forward compiles in its "cake" backend)."""
    import builtins

    try:
        tree = ast.parse((package_dir / package_path(file)).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    name = function.rpartition(".")[2]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return any(isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and hasattr(builtins, n.func.id))
                       for n in ast.walk(node))
    return False


def coverage_report() -> dict[str, Any]:
    """The doctor's view: installed versions, active settings, and the classified site table."""
    import importlib.metadata

    from .. import _version, config
    from ..keys import targets
    from ..keys.key import dsl_stack_string

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
    except Exception as exc:  # noqa: BLE001 - the doctor must work with a broken DSL install
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
    if version is None or not _native_release(version):
        return None
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(Path.home())
    return str(Path(base) / ".cache" / "flashinfer" / version / "<archs>" / "cached_ops")
