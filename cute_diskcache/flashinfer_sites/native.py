"""Owns the one exception to the hook: sites flashinfer builds through its own disk cache.

From 0.6.18 flashinfer persists some sm12x kernels itself through ``jit.cute_dsl_core.
build_and_load_cute_dsl_kernel(module, name, compile_fn, ...)`` (the :data:`.sites.ROWS` marked
``native``). That builder reads flashinfer's disk cache *before* anything compiles, keyed with a
fingerprint of torch's build (a cache prewarmed with a CPU torch misses on the GPU box, and the
mismatch wipes the module directory), so a hook on ``cute.compile`` alone would come too late and
leave a kernel in two caches. For those callers this module stands in front of the builder:

* ``CUTE_DISKCACHE_NATIVE_SITES=cute-diskcache`` (default): the builder is skipped and
  ``compile_fn`` runs, its ``cute.compile`` keyed by the hook like every site's (without torch).
  A compile the hook cannot key is handed back (:class:`~..core.hook.HandBack`) to flashinfer's builder.
* ``=flashinfer``: flashinfer's builder builds it; while planning we only record which kernel it
  would build (as flashinfer's cache computes it), otherwise whether it hit (:data:`EVENTS`).

The builder is replaced where callers find it: the module attribute (imported at call time) and
moe_dispatch's global (imported by name); every other caller reaches flashinfer's as before.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import sys
import time
from types import ModuleType
from typing import Any
from collections.abc import Callable

from ..core.patches import PATCHES
from ..core import through
from . import _common
from ..core import hook
from .names import CUTE_DSL_CORE, MOE_DISPATCH
from .sites import Row

log = logging.getLogger("cute_diskcache")

BUILDER = "build_and_load_cute_dsl_kernel"
_MARKER = "_cdc_native"
#: flashinfer's own builds of native sites while they are left to it: hit/miss records for
#: prewarm's workers and the dispatcher (appended here, read by :mod:`.driving`).
EVENTS: list[dict[str, Any]] = []
_WARNED: set[str] = set()


def serves_native() -> bool:
    """Whether flashinfer's natively cached sites are ours to serve (``CUTE_DISKCACHE_NATIVE_SITES``)."""
    from .. import config

    return not config.left_to_library("flashinfer", config.load().native_sites)


def _caller_row(frame: Any) -> Row | None:
    found = hook._classify(frame.f_code)
    return found if isinstance(found, Row) and found.native else None


def _builder(real: Callable[..., Any]) -> Callable[..., Any]:
    """``build_and_load_cute_dsl_kernel`` as flashinfer's sm12x callers see it."""

    @functools.wraps(real)
    def build_and_load_cute_dsl_kernel(module_name: str, kernel_name: str, compile_fn: Callable[[], Any],
                                       extra_key_files: Any = (), **kwargs: Any) -> Any:
        row = _caller_row(sys._getframe(1))

        def flashinfers() -> Any:
            return real(module_name, kernel_name, compile_fn, extra_key_files, **kwargs)

        if row is None or set(kwargs) - {"enable_tvm_ffi"}:
            return flashinfers()
        if not serves_native():
            return _left_to_flashinfer(row, real, module_name, kernel_name, compile_fn, extra_key_files, kwargs)
        seen: list[Row] = []
        token = hook.SERVING_NATIVE.set(seen)
        try:
            kernel = compile_fn()  # its cute.compile goes through the hook
        except hook.HandBack:
            return flashinfers()
        finally:
            hook.SERVING_NATIVE.reset(token)
        if not seen and row.name not in _WARNED:  # compile_fn compiled outside cute.compile
            _WARNED.add(row.name)
            log.warning("cute-diskcache: %s built without a cute.compile the cache saw; it stays in memory", row.name)
        return kernel

    setattr(build_and_load_cute_dsl_kernel, _MARKER, True)
    return build_and_load_cute_dsl_kernel


def _left_to_flashinfer(row: Row, real: Callable[..., Any], module_name: str, kernel_name: str,
                        compile_fn: Callable[[], Any], extra_key_files: Any, kwargs: dict[str, Any]) -> Any:
    """Opt-out: flashinfer builds it; while planning, only record which kernel it would build."""
    ident = native_identity(module_name, kernel_name, compile_fn, extra_key_files, bool(kwargs.get("enable_tvm_ffi", True)))
    ident["kind"] = f"native-{row.kind}"
    if through.PLAN is not None:
        through.PLAN.append({"kind": ident["kind"], "digest": ident["digest"], "site": ident["name"], "native": True,
                             "cached": ident["cached"], "path": ident.get("path")})
        return through.PlannedKernel(ident["digest"])
    ran: list[float] = []

    def counted() -> Any:
        t = time.perf_counter()
        try:
            return compile_fn()
        finally:
            ran.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    result = real(module_name, kernel_name, counted, extra_key_files, **kwargs)
    EVENTS.append({"digest": ident["digest"], "kind": ident["kind"], "site": ident["name"], "path": ident.get("path"),
                   "outcome": "miss" if ran else "hit", "seconds": ran[0] if ran else time.perf_counter() - t0})
    return result


def native_identity(module_name: str, kernel_name: str, compile_fn: Any, extra_key_files: Any, enable_tvm_ffi: bool) -> dict[str, Any]:
    """Which native kernel a ``build_and_load_cute_dsl_kernel`` call is, and whether it is on disk.

    Computed as flashinfer's cache does (same spec, same source hash) without compiling.
    """
    from flashinfer.jit import cute_dsl_core as core

    kind = "native-" + kernel_name.split("_", 1)[0]
    out: dict[str, Any] = {"kind": kind, "name": f"{module_name}/{kernel_name}", "cached": False, "native": True}
    try:
        disabled = core.cute_dsl_cache_disabled()
        sha = core._hash_source_files(tuple(extra_key_files))
        spec = core.JitSpecCuteDsl(module_name, kernel_name, compile_fn, sha, **_spec_options(core, enable_tvm_ffi))
        out.update(name=spec.name, path=str(spec.object_path), cached=bool(spec.is_compiled) and not disabled,
                   disabled=disabled)
        ident = json.dumps([spec.name, spec.expected_meta, str(spec.object_path)], sort_keys=True)
    except Exception as exc:  # noqa: BLE001 - identity is for reporting; a failure must not stop dispatch
        if "identity" not in _WARNED:  # once: a release whose native cache API moved shows up, not every kernel
            _WARNED.add("identity")
            log.warning("flashinfer %s: cannot tell whether its native kernels are cached (%s: %s); prewarm "
                        "will list them as missing", _common.flashinfer_version(), type(exc).__name__, exc)
        ident = json.dumps([module_name, kernel_name])
    out["digest"] = hashlib.sha256(ident.encode()).hexdigest()
    return out


def _spec_options(core: ModuleType, enable_tvm_ffi: bool) -> dict[str, Any]:
    """The keywords this release's ``JitSpecCuteDsl`` takes beyond the four positional ones.

    ``enable_tvm_ffi`` arrived in 0.7.4; 0.6.18-0.7.2.post1 build every native kernel with
    tvm-ffi and passing it is a TypeError (which once made every native kernel look uncached).
    """
    import inspect

    if "enable_tvm_ffi" in inspect.signature(core.JitSpecCuteDsl.__init__).parameters:
        return {"enable_tvm_ffi": enable_tvm_ffi}
    if not enable_tvm_ffi:
        raise TypeError(f"flashinfer {_common.flashinfer_version()} builds native kernels with tvm-ffi only")
    return {}


def serving(md: ModuleType | None = None) -> bool:
    """Whether moe_dispatch's native sites go through our cache in this process right now."""
    md = md if md is not None else sys.modules.get(MOE_DISPATCH)
    return (md is not None and getattr(md.__dict__.get(BUILDER), _MARKER, False) and serves_native())


def patch(module: ModuleType) -> bool:
    """Stand in front of flashinfer's builder where ``module`` holds it (idempotent)."""
    if module.__name__ not in (CUTE_DSL_CORE, MOE_DISPATCH) or BUILDER not in module.__dict__:
        return False
    return PATCHES.replace(module, BUILDER, _MARKER, _builder)


def unpatch(module: ModuleType) -> None:
    if module.__name__ in (CUTE_DSL_CORE, MOE_DISPATCH):
        PATCHES.restore(module, (BUILDER,))


__all__ = ["BUILDER", "EVENTS", "native_identity", "patch", "serves_native", "serving", "unpatch"]
