"""Which flashinfer and DSL releases cute-diskcache works with, and what it does with the others.

The facts come from the compatibility matrix (``scripts/compat_matrix.py``, results in
``compat/``): every release listed in :data:`VERIFIED` had each site kind it covers compiled
through flashinfer's own dispatch and then hit in a fresh process with zero compiles.

**Refused combinations** (:data:`REFUSED`): a flashinfer with a DSL that the matrix showed cannot
compile its kernels. cute-diskcache then attaches nothing and says so in one log line; flashinfer
runs as it would without us (and fails the same way), rather than a cache half-working.

**Unverified releases** (a 0.7.3, a 0.8 that appears later). The danger is a site whose
in-process key no longer captures a codegen input. What can be checked is checked, from the
release's own source, before a site is cached (:func:`site_problems`):

* the site function still exists;
* every frame local the adapter's key reads is still a local of that function;
* the compile call still has the shape the adapter keys: the same callee, and no keyword the
  key does not capture (``cute.compile(..., options=...)`` is keyed; a new keyword is not);
* module state the adapter relies on (the W4A16 compiler's memo dict and lock) still exists.

A site that passes is cached (its key is flashinfer's own in-process memo key plus the content
hash of the sources it reaches, so a codegen input that key misses would already make flashinfer
reuse a wrong kernel in memory); one that fails is passed through to flashinfer, uncached, with
one warning naming the site and the check. ``doctor`` lists every site's checks on such a release.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import logging
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Sequence

from ._common import flashinfer_version, version_tuple

log = logging.getLogger("cute_diskcache")

#: flashinfer releases the matrix proved (compat/cells/*.json, status "proven"). Kept equal to the
#: matrix by tests/test_compat.py::test_verified_releases_are_the_proven_matrix_cells.
VERIFIED: tuple[str, ...] = (
    "0.6.12", "0.6.13", "0.6.14", "0.6.15.post1", "0.6.16.post4", "0.6.17",
    "0.6.18.post1", "0.7.0.post1", "0.7.1", "0.7.2", "0.7.2.post1", "0.7.4",
)


@dataclasses.dataclass(frozen=True)
class Refused:
    """A flashinfer range with a DSL range (half-open, version tuples) that cannot work.

    ``lacking``: the combination fails only when this distribution is absent (the DSL's CUDA 13
    libraries, which carry the ptxas that knows sm_120a's block-scaled MMA). ``evidence``: the
    compatibility matrix's site whose failure, with the DSL's own error, is the record.
    """

    flashinfer: tuple[tuple[int, ...], tuple[int, ...]]
    dsl: tuple[tuple[int, ...], tuple[int, ...]]
    reason: str
    lacking: str | None = None
    evidence: str = "micro"

    def matches(self, fi: str, dsl: str, installed: Iterable[str]) -> bool:
        f, d = version_tuple(fi)[:3], version_tuple(dsl)[:3]
        return (self.flashinfer[0] <= f < self.flashinfer[1] and self.dsl[0] <= d < self.dsl[1]
                and (self.lacking is None or self.lacking not in set(installed)))


REFUSED: tuple[Refused, ...] = (
    Refused(
        flashinfer=((0, 6, 12), (0, 6, 18)),
        dsl=((4, 5, 0), (4, 6, 0)),
        lacking="nvidia-cutlass-dsl-libs-cu13",
        reason=("nvidia-cutlass-dsl 4.5 without its cu13 libraries cannot assemble the sm12x MoE kernels "
                "(ptxas: \"Unexpected instruction types specified for '_mma'\"); install nvidia-cutlass-dsl[cu13]"),
    ),
    Refused(
        flashinfer=((0, 7, 1), (99,)),
        dsl=((4, 6, 0), (4, 7, 0)),
        reason=("its nvfp4 W4A4/W4A16 MoE runners import cutlass.experimental, which nvidia-cutlass-dsl 4.6 does not "
                "have (flashinfer's cu12/cu13 extras require >= 4.7); install nvidia-cutlass-dsl>=4.7"),
        evidence="w4a4",
    ),
)

_DSL_DISTS = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13")


def _installed(names: Sequence[str]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


@functools.lru_cache(maxsize=1)
def refused_rule() -> Refused | None:
    """The rule refusing this process's flashinfer + DSL combination (None: none does).

    Read from distribution metadata only (a few lookups), never by importing the DSL.
    """
    dists = _installed(_DSL_DISTS)
    dsl = dists.get("nvidia-cutlass-dsl")
    if dsl is None:
        return None
    return next((rule for rule in REFUSED if rule.matches(flashinfer_version(), dsl, dists)), None)


def refusal() -> str | None:
    """Why this process's flashinfer + DSL combination is refused (None: it is not)."""
    rule = refused_rule()
    if rule is None:
        return None
    return f"flashinfer {flashinfer_version()} with nvidia-cutlass-dsl {_installed(_DSL_DISTS[:1])['nvidia-cutlass-dsl']}: {rule.reason}"


_REFUSAL_LOGGED: list[bool] = []


def refused() -> bool:
    """True when the combination is refused; the first call logs the one line that says why."""
    reason = refusal()
    if reason is not None and not _REFUSAL_LOGGED:
        _REFUSAL_LOGGED.append(True)
        log.warning("cute-diskcache refuses %s; flashinfer runs uncached", reason)
    return reason is not None


def verified(version: str | None = None) -> bool:
    return (version or flashinfer_version()) in VERIFIED


# --------------------------------------------------------------------------------------------
# Site checks for releases outside VERIFIED
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SiteShape:
    """What an adapter site relies on in flashinfer's source.

    ``reads``: frame locals (or parameters) the key reads. ``calls``: callee (``cute.compile``
    or ``build_and_load_cute_dsl_kernel``) -> the keywords it may pass, all of them keyed
    (``**`` where the verified releases already pass a mapping whose keys are checked at run
    time). ``module_globals``: names the adapter uses in the site's module.
    """

    reads: tuple[str, ...] = ()
    calls: tuple[tuple[str, frozenset[str]], ...] = ()
    module_globals: tuple[str, ...] = ()


COMPILE = "cute.compile"
BUILDER = "build_and_load_cute_dsl_kernel"


def shape(reads: Sequence[str] = (), module_globals: Sequence[str] = (), **calls: Iterable[str]) -> SiteShape:
    """``shape(("cache_key",), cute_compile={"options"})``: keyword names use ``_`` for ``.``."""
    return SiteShape(tuple(reads), tuple((k.replace("cute_compile", COMPILE), frozenset(v)) for k, v in calls.items()),
                     tuple(module_globals))


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _frame_locals(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameters and names bound in ``fn``'s own scope (nested functions and lambdas excluded)."""
    a = fn.args
    names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    names.update(p.arg for p in (a.vararg, a.kwarg) if p is not None)
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _callee(node: ast.Call) -> str | None:
    func = node.func.value if isinstance(node.func, ast.Subscript) else node.func  # cute.compile[opts](...)
    if isinstance(func, ast.Attribute) and func.attr == "compile" and isinstance(func.value, ast.Name):
        return COMPILE  # cute.compile under any alias of cutlass.cute
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return BUILDER if name == BUILDER else None


def _module_globals(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return out


def site_problems(tree: ast.Module, function: str, expected: SiteShape) -> list[str]:
    """What no longer matches ``expected`` in ``function`` of a parsed flashinfer module ([] = fine)."""
    fn = _function(tree, function)
    if fn is None:
        return [f"function {function} is gone"]
    problems = []
    missing = [name for name in expected.reads if name not in _frame_locals(fn)]
    if missing:
        problems.append(f"locals the key reads are gone: {', '.join(missing)}")
    found: dict[str, list[set[str]]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and (callee := _callee(node)) is not None:
            found.setdefault(callee, []).append({k.arg or "**" for k in node.keywords})
    for callee, allowed in expected.calls:
        if callee not in found:
            problems.append(f"no {callee} call any more")
            continue
        extra = sorted(set().union(*found[callee]) - allowed)
        if extra:
            problems.append(f"{callee} passes {', '.join(extra)}, which the key does not capture")
    gone = [name for name in expected.module_globals if name not in _module_globals(tree)]
    if gone:
        problems.append(f"module state gone: {', '.join(gone)}")
    return problems


@functools.lru_cache(maxsize=None)
def _parsed(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def checks(module: ModuleType | Path, shapes: dict[str, SiteShape]) -> dict[str, list[str]]:
    """function -> problems, for the sites of one module (a module object or its source file)."""
    path = str(module) if isinstance(module, Path) else getattr(module, "__file__", None)
    tree = _parsed(path) if path else None
    if tree is None:
        return {fn: ["source unavailable"] for fn in shapes}
    return {fn: site_problems(tree, fn, expected) for fn, expected in shapes.items()}


_WARNED: set[tuple[str, str]] = set()


def vetted(module: ModuleType, functions: Iterable[str], shapes: dict[str, SiteShape]) -> set[str]:
    """The site functions of ``module`` to cache: all of them on a verified release; on any other
    release, those whose checks pass, with one warning for each one passed through."""
    functions = set(functions)
    version = flashinfer_version()
    if verified(version):
        return functions
    ok = set()
    results = checks(module, {fn: shapes[fn] for fn in functions if fn in shapes})
    for fn in sorted(functions):
        problems = results.get(fn, ["no checks known for this site"])
        where = f"{module.__name__.rsplit('.', 1)[-1]}.{fn}"
        if (module.__name__, fn) in _WARNED:
            pass
        elif problems:
            log.warning("flashinfer %s is not a verified release and %s changed (%s): that site is passed through "
                        "uncached", version, where, "; ".join(problems))
        else:
            log.info("flashinfer %s is not a verified release; %s passed its checks and is cached", version, where)
        _WARNED.add((module.__name__, fn))
        if not problems:
            ok.add(fn)
    return ok


def module_file(package_dir: Path, module_name: str) -> Path:
    """The source file of a flashinfer module, under an installed (or unpacked) package dir."""
    rel = module_name.split(".", 1)[1].replace(".", "/") + ".py"
    return package_dir / rel


def report(package_dir: Path, version: str, tables: dict[str, dict[str, SiteShape]]) -> dict[str, Any]:
    """For doctor: verified or not, the refusal (if any), and each adapter site's checks.

    ``tables``: module name -> function -> shape, of the generation serving ``version``. The
    refusal is only asked for the installed flashinfer (it reads the installed DSL).
    """
    site_checks = {}
    for module_name, shapes in tables.items():
        path = module_file(package_dir, module_name)
        if not path.is_file():
            continue
        for fn, problems in checks(path, shapes).items():
            site_checks[f"{path.name}:{fn}"] = problems
    return {
        "verified": verified(version),
        "verified_releases": list(VERIFIED),
        "refused": refusal() if version == flashinfer_version() else None,
        "refused_evidence": refused_rule().evidence if version == flashinfer_version() and refused_rule() else None,
        "site_checks": site_checks,
    }
