"""flashinfer's kernel getters: functions whose arguments determine the kernel they compile.

Some sm12x kernels are built by a getter that takes the configuration as arguments, imports the
kernel class inside its body, calls ``cute.compile`` and memoises the result in memory (a module
dict or ``functools.cache``): every start compiles every configuration again. ``cute`` is
imported inside those functions, so there is no module global to proxy: the getters themselves
are replaced, in the module that calls them by name. Covered (:data:`GETTERS`):

* the BF16 x FP4 dense GEMM and its m=1 GEMV (``mm_bf16_fp4(backend="cute-dsl")``, what vLLM
  runs for the linear layers of a W4A16 NVFP4 checkpoint);
* MSA (MiniMax sparse attention) on SM12x: the top-k block select, the sparse-decode combine and
  the sparse-prefill union kernels.

Site key: every argument of the getter, bound to its signature with defaults applied (a
superset of flashinfer's in-process key, which is built from exactly those arguments), plus
every device answer the getter reads: ``get_max_active_clusters(n)`` for each literal ``n`` it
passes (the BF16 x FP4 GEMM bakes that into its persistent grid). What the code reads beyond its
arguments is read from its source when it is patched: the flashinfer modules it imports inside
the function (the kernel classes) join the source fingerprint with its own module (and what
that reaches through globals), and a getter that asks the device anything else, or asks it with
a computed argument, is left uncached with one warning: a miss is cheap, a wrong kernel is not.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import logging
import re
import textwrap
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from . import _common, gemm
from ._common import PATCHES, Call, Site, plain
from .names import GEMM_BF16_FP4, MSA_DECODE, MSA_PREFILL, MSA_TOPK

log = logging.getLogger("cute_diskcache")


@dataclasses.dataclass(frozen=True)
class Getter:
    """One getter: where it is, what the site is called, and the key's family."""

    module: str
    function: str
    kind: str
    family: str  # the key's first element and the site's name: flashinfer.<family>.<kind>
    env_kind: str  # the namespace's prefix

    @property
    def file(self) -> str:
        """Its file relative to flashinfer's package, as the coverage report names it."""
        return self.module.removeprefix("flashinfer.").replace(".", "/") + ".py"


GETTERS = (
    Getter(GEMM_BF16_FP4, "_get_cute_dsl_bf16_fp4_gemm", "bf16_fp4_gemm", "gemm", "flashinfer-gemm"),
    Getter(GEMM_BF16_FP4, "_get_cute_dsl_bf16_fp4_gemv", "bf16_fp4_gemv", "gemm", "flashinfer-gemm"),
    Getter(MSA_TOPK, "_get_compiled_topk", "msa_topk", "msa", "flashinfer-msa"),
    Getter(MSA_DECODE, "_get_compiled_combine", "msa_combine", "msa", "flashinfer-msa"),
    Getter(MSA_PREFILL, "_get_compiled_union", "msa_union", "msa", "flashinfer-msa"),
)
MODULES = frozenset(g.module for g in GETTERS)
#: (file relative to flashinfer's package, function) -> kind, for the coverage report.
COVERED = {(g.file, g.function): g.kind for g in GETTERS}

#: Device queries a getter may make: only this one, and only with literal arguments, is keyed.
_DEVICE_QUERY = "get_max_active_clusters"
_OTHER_DEVICE_QUERIES = ("get_compute_capability", "get_device_sm_count", "torch.cuda.", "get_device_properties")
_MARKER = "_cdc_getter"
_ABSENT = object()


class _Unsupported(Exception):
    """The getter reads something its arguments do not carry that we cannot key."""


def read_getter(func: Callable[..., Any]) -> tuple[tuple[tuple[str, str], ...], tuple[int, ...]]:
    """What ``func`` reads beyond its arguments, from its source: ``(module, name)`` of each
    flashinfer import inside its body (the kernel classes), and the literal cluster sizes it
    asks ``get_max_active_clusters`` for. Nothing is imported here (the import hook calls
    :func:`patch` while flashinfer is still importing).

    Raises :class:`_Unsupported` when the source cannot be read or the function asks the device
    something we cannot key.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise _Unsupported(f"source unreadable: {exc}") from exc
    package = func.__module__.rpartition(".")[0]
    imports: list[tuple[str, str]] = []
    sizes: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "flashinfer"):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            imports.extend((base, alias.name) for alias in node.names)
        elif isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called.rpartition(".")[2] == _DEVICE_QUERY:
                arg = node.args[0] if len(node.args) == 1 and not node.keywords else None
                if not (isinstance(arg, ast.Constant) and type(arg.value) is int):
                    raise _Unsupported(f"{ast.unparse(node)} is not keyed (not one integer literal)")
                sizes.append(arg.value)
            elif any(q in called for q in _OTHER_DEVICE_QUERIES):
                raise _Unsupported(f"{ast.unparse(node)} asks the device something the key does not carry")
    return tuple(dict.fromkeys(imports)), tuple(sorted(set(sizes)))


def kernel_modules(imports: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """The flashinfer modules behind those imports (``from .pkg import mod`` names a module,
    ``from .mod import Cls`` a name in one), imported: the getter imports them anyway."""
    out: list[str] = []
    for base, name in imports:
        module = importlib.import_module(base)
        out.append(base)
        if isinstance(getattr(module, name, None), ModuleType):
            out.append(getattr(module, name).__name__)
    return tuple(dict.fromkeys(out))


def covered(package_dir: Path) -> dict[tuple[str, str], str]:
    """:data:`COVERED` for the installed release: the getters its files define (the BF16 x FP4
    GEMV arrived in 0.6.18, the GEMM in 0.6.14, MSA in 0.6.18). A getter renamed upstream is then
    simply not ours: the scan lists the new function as nobody's, which ``--strict`` reports."""
    out = {}
    for (file, function), kind in COVERED.items():
        path = package_dir / file
        if path.is_file() and re.search(rf"^def {re.escape(function)}\(", path.read_text(errors="replace"), re.M):
            out[(file, function)] = kind
    return out


def _key(call: Call) -> Any:
    v = call.locals
    return (v["family"], v["getter"], ("args", tuple(sorted((k, plain(x)) for k, x in v["args"].items()))),
            ("max_active_clusters", v["max_active_clusters"]))


def _modules(call: Call) -> tuple[str, ...]:
    return tuple(dict.fromkeys((call.locals["module"], *call.locals["kernel_modules"])))


def _site(getter: Getter) -> Site:
    return Site(getter.module, getter.function, getter.kind, _key, options=lambda call: None, modules=_modules,
                extra=gemm.convention, extra_ok=gemm.convention_ok, adapt=gemm.as_compiled,
                site_name=f"flashinfer.{getter.family}.{getter.kind}", env_kind=getter.env_kind)


def _wrap(getter: Getter, real: Any) -> Callable[..., Any] | None:
    """The getter as its module sees it: each kernel through our cache, memoised in-process."""
    if not callable(real):
        return None
    try:
        imports, sizes = read_getter(real)
        signature = inspect.signature(real)
    except (_Unsupported, TypeError, ValueError) as exc:
        log.warning("flashinfer %s: %s.%s stays uncached: %s", _common.flashinfer_version(), getter.module, getter.function, exc)
        return None
    site = _site(getter)
    memo: dict[Any, Any] = {}
    # The arguments exactly as flashinfer passed them -> kernel: flashinfer calls the getter on
    # every GEMM/attention call, so a repeat must cost what flashinfer's own memo costs (one dict
    # lookup), not a signature bind and a key. Keyed like flashinfer's memo (by its arguments).
    seen: dict[Any, Any] = {}
    lock = threading.Lock()
    modules: list[tuple[str, ...]] = []  # resolved at the first call

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        raw: Any = (args, tuple(kwargs.items()))
        try:
            return seen[raw]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument (a list): the full path below, every time
            raw = None
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return real(*args, **kwargs)  # flashinfer's own error
        bound.apply_defaults()
        try:
            mac: tuple[tuple[int, int], ...] = ()
            if sizes:
                from flashinfer.cute_dsl.utils import get_max_active_clusters  # what the getter itself reads

                mac = tuple((n, get_max_active_clusters(n)) for n in sizes)
            if not modules:
                modules.append(kernel_modules(imports))
        except Exception as exc:  # e.g. a kernel module of a branch this call does not take fails to import
            log.debug("%s.%s uncached for this call: %s", getter.module, getter.function, exc)
            return real(*args, **kwargs)
        call = Call({"family": getter.family, "getter": getter.function, "module": getter.module,
                     "args": dict(bound.arguments), "max_active_clusters": mac, "kernel_modules": modules[0]}, (), {})
        mem_key = _key(call)
        with lock:
            kernel = memo.get(mem_key, _ABSENT)
        if kernel is _ABSENT:
            kernel = _common.through_cache(site, call, lambda: real(*args, **kwargs))
        with lock:  # a planned kernel too: a planning process never serves
            memo[mem_key] = kernel
            if raw is not None:
                seen[raw] = kernel
        return kernel

    setattr(wrapper, _MARKER, True)
    return wrapper


def patch(module: ModuleType) -> bool:
    """Route the module's getters through the cache (idempotent); True if any."""
    done = [PATCHES.replace(module, g.function, _MARKER, functools.partial(_wrap, g))
            for g in GETTERS if g.module == module.__name__ and g.function in module.__dict__]
    return any(done)


def unpatch(module: ModuleType) -> None:
    names = tuple(g.function for g in GETTERS if g.module == module.__name__)
    if names:
        PATCHES.restore(module, names)
