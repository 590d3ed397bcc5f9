"""flashinfer's natively cached sm12x kernels outside moe_dispatch, served from our cache.

flashinfer (0.6.18+) persists some sm12x kernels itself through
``jit.cute_dsl_core.build_and_load_cute_dsl_kernel``: the SM12x CuTe FP4 GEMM runner
(``mm_fp4(backend="cute-dsl")`` on SM120/SM121), the SM120 FP8 FMHA (ragged and paged), the
SM120 KDA prefill and the cuDNN-Frost MoE backend's sm_120a sources. Its key for them includes a fingerprint of
torch's build, so a cache prewarmed with a CPU torch misses on the GPU box (and the mismatch
wipes the module directory): the problem :mod:`.v0_7` solves for moe_dispatch's three kernels,
solved the same way. By default (``CUTE_DISKCACHE_NATIVE_SITES=cute-diskcache``) a call from one
of :data:`SITES` (the SM12x CuTe GEMM and the SM120 FMHA; :data:`NOT_SERVED` says why the others
are not yet) goes through our cache, keyed without torch; flashinfer's builder is then not called
for it (its ``cached_ops`` is neither read nor written). ``=flashinfer`` leaves them to it.

These callers import the builder inside the function (``from ...jit.cute_dsl_core import
build_and_load_cute_dsl_kernel``), which reads the module attribute at call time, so that
attribute is where we stand. Only the listed functions are served, recognised by their code
object; every other caller (flashinfer's norm, attention, GEMM kernels for other archs, and
moe_dispatch, which holds its own reference) reaches flashinfer's builder as before.

Site key: flashinfer's disk identity of the kernel (module and kernel name, which encode every
specialisation parameter: flashinfer's own cache relies on that), the sha256 of every file it
names as a key source, and the export format; plus, per site, the caller's own in-process key
locals. Files that are imported modules also join the source fingerprint (with the modules
they reach and the environment variables those read).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import sys
import time
from types import ModuleType
from typing import Any, Callable

from ..key import UnkeyableError
from . import _common
from ._common import PATCHES, Call, Site

log = logging.getLogger("cute_diskcache")

CORE = "flashinfer.jit.cute_dsl_core"
BUILDER = "build_and_load_cute_dsl_kernel"
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class NativeSite:
    """One flashinfer function that builds an sm12x kernel through the native builder."""

    module: str
    function: str
    kind: str
    file: str  # relative to flashinfer's package, for the coverage report
    key_locals: tuple[str, ...] = ()  # the caller's in-process key, read from its frame
    env_kind: str = "flashinfer-moe"
    #: Only calls whose locals pass this are sm12x ones (a caller that serves several archs).
    applies: Callable[[dict[str, Any]], bool] = lambda _locals: True


SITES = (
    NativeSite("flashinfer.gemm.kernels.sm12x_cute.runner", "_compile", "sm12x_cute", "gemm/kernels/sm12x_cute/runner.py",
               key_locals=("n", "k", "tactic", "compute_capability"), env_kind="flashinfer-gemm"),
    NativeSite("flashinfer.cute_dsl.attention.fmha.sm120.compile", "compile_sm120_fmha_fp8_ragged_kernel", "fmha_sm120_ragged",
               "cute_dsl/attention/fmha/sm120/compile.py", env_kind="flashinfer-attention"),
    NativeSite("flashinfer.cute_dsl.attention.fmha.sm120.compile", "compile_sm120_fmha_fp8_paged_kernel", "fmha_sm120_paged",
               "cute_dsl/attention/fmha/sm120/compile.py", env_kind="flashinfer-attention"),
)
#: Natively cached sm12x sites left to flashinfer's cache for now, and why: each compiles only
#: under ``torch.cuda.device`` / from kernel sources its engine specialises for the device, which
#: a box without the card cannot drive, so serving them from ours could not be proven here.
#: ``doctor`` lists them as flashinfer's.
NOT_SERVED = {
    ("fused_moe/backends/cudnn_frost/runtime.py", "_load_source_cached"):
        "cuDNN-Frost compiles sources its engine materialises for the device",
    ("kda_kernels/sm120_prefill/runtime.py", "build_kernel"): "compiles under torch.cuda.device",
}
#: (file relative to flashinfer's package, function) -> kind, for the coverage report while we serve them.
COVERED = {(s.file, s.function): s.kind for s in SITES}


@functools.lru_cache(maxsize=None)
def _site_code(module: str, function: str) -> Any:
    """The code object of a site function, once its module is imported (None before)."""
    mod = sys.modules.get(module)
    fn = getattr(mod, function, None) if mod is not None else None
    try:
        fn = inspect.unwrap(fn) if fn is not None else None  # functools.cache / lru_cache
    except ValueError:
        return None
    return getattr(fn, "__code__", None)


def _caller_site(frame: Any) -> NativeSite | None:
    name = frame.f_globals.get("__name__")
    for site in SITES:
        if site.module == name and frame.f_code.co_name == site.function:
            code = _site_code(site.module, site.function)
            if code is None:
                _site_code.cache_clear()  # imported after a miss was memoised
                code = _site_code(site.module, site.function)
            if frame.f_code is code:
                return site
    return None


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def key_sources(files: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """flashinfer's key files: (imported flashinfer modules among them, (name, sha256) of each).

    A module is named by its import name, any other file (a generated kernel source) by its
    base name: never an absolute path, so a cache copied to another prefix still hits. A file
    we cannot read is a key we cannot build: the kernel then goes to flashinfer's builder.
    """
    by_file = {os.path.realpath(f): name for name, mod in list(sys.modules.items())
               if name.startswith("flashinfer") and isinstance(f := getattr(mod, "__file__", None), str)}
    modules, digests = [], []
    for path in files:
        path = str(path)
        try:
            st = os.stat(path)
            digest = _file_digest(os.path.realpath(path), st.st_size, st.st_mtime_ns)
        except OSError as exc:
            raise UnkeyableError(f"key source {os.path.basename(path)} unreadable: {exc}") from None
        module = by_file.get(os.path.realpath(path))
        if module is not None:
            modules.append(module)
        digests.append((module or os.path.basename(path), digest))
    return tuple(dict.fromkeys(modules)), tuple(digests)


def _key(call: Call) -> Any:
    v = call.locals
    return ("native", v["module_name"], v["kernel_name"], v["digests"], ("enable_tvm_ffi", v["enable_tvm_ffi"]),
            ("caller", tuple((name, _common.plain(v["caller"][name])) for name in sorted(v["caller"]))))


def _site(native: NativeSite) -> Site:
    def modules(call: Call) -> tuple[str, ...]:
        return tuple(dict.fromkeys((native.module, *call.locals["key_modules"])))

    return Site(native.module, native.function, native.kind, _key, options=lambda call: None, modules=modules,
                site_name=f"flashinfer.native.{native.kind}", env_kind=native.env_kind)


_SITE_OBJECTS = {(s.module, s.function): _site(s) for s in SITES}
#: flashinfer's own builds of these sites while they are left to it (opt-out): hit/miss records
#: for prewarm's workers, appended by the builder, read and cleared by the dispatcher.
NATIVE_EVENTS: list[dict[str, Any]] = []


def _builder(real: Callable[..., Any]) -> Callable[..., Any]:
    """``build_and_load_cute_dsl_kernel`` as flashinfer's sm12x callers see it."""

    @functools.wraps(real)
    def build_and_load_cute_dsl_kernel(module_name: str, kernel_name: str, compile_fn: Callable[[], Any],
                                       extra_key_files: Any = (), **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        native = _caller_site(frame)
        caller_locals = dict(frame.f_locals) if native is not None else {}
        del frame

        def flashinfers() -> Any:
            return real(module_name, kernel_name, compile_fn, extra_key_files, **kwargs)

        if native is None or set(kwargs) - {"enable_tvm_ffi"} or not native.applies(caller_locals):
            return flashinfers()
        enable_tvm_ffi = bool(kwargs.get("enable_tvm_ffi", True))
        from .v0_7 import serves_native

        if not serves_native():
            return _left_to_flashinfer(native, flashinfers, module_name, kernel_name, compile_fn, extra_key_files, enable_tvm_ffi)
        missing = [name for name in native.key_locals if name not in caller_locals]
        if missing:  # the caller changed shape: never a weaker key
            log.warning("not caching %s kernel: its caller has no %s", native.kind, ", ".join(missing))
            return flashinfers()
        try:
            key_modules, digests = key_sources(tuple(str(f) for f in extra_key_files))
        except UnkeyableError as exc:
            log.warning("not caching %s kernel: %s", native.kind, exc)
            return flashinfers()
        call = Call({"module_name": module_name, "kernel_name": kernel_name, "digests": digests, "key_modules": key_modules,
                     "enable_tvm_ffi": enable_tvm_ffi, "caller": {n: caller_locals[n] for n in native.key_locals}}, (), {})
        return _common.through_cache(_SITE_OBJECTS[native.module, native.function], call, compile_fn, uncached=flashinfers)

    build_and_load_cute_dsl_kernel._cdc_native_sm12x = True  # type: ignore[attr-defined]
    return build_and_load_cute_dsl_kernel


def _left_to_flashinfer(native: NativeSite, build: Callable[[], Any], module_name: str, kernel_name: str,
                        compile_fn: Callable[[], Any], extra_key_files: Any, enable_tvm_ffi: bool) -> Any:
    """Opt-out: flashinfer builds it; while planning, only record which kernel it would build."""
    from .v0_7 import native_identity

    ident = native_identity(module_name, kernel_name, compile_fn, extra_key_files, enable_tvm_ffi)
    ident["kind"] = f"native-{native.kind}"
    if _common.PLAN is not None:
        _common.PLAN.append({"kind": ident["kind"], "digest": ident["digest"], "site": ident["name"], "native": True,
                             "cached": ident["cached"], "path": ident.get("path")})
        return _common.PlannedKernel(ident["digest"])
    t0 = time.perf_counter()
    before = os.path.getmtime(ident["path"]) if ident.get("path") and os.path.exists(ident["path"]) else None
    result = build()
    after = os.path.getmtime(ident["path"]) if ident.get("path") and os.path.exists(ident["path"]) else None
    NATIVE_EVENTS.append({"digest": ident["digest"], "kind": ident["kind"], "site": ident["name"], "path": ident.get("path"),
                          "outcome": "hit" if before is not None and before == after else "miss",
                          "seconds": time.perf_counter() - t0})
    return result


def patch(module: ModuleType) -> bool:
    """Stand between flashinfer's native builder and its sm12x callers (idempotent)."""
    return module.__name__ == CORE and PATCHES.replace(module, BUILDER, "_cdc_native_sm12x", _builder)


def unpatch(module: ModuleType) -> None:
    if module.__name__ == CORE:
        PATCHES.restore(module, (BUILDER,))
