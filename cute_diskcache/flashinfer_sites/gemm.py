"""flashinfer's b12x dense GEMMs for SM120/SM121: block-scaled FP4 and MXFP8.

``mm_fp4(..., backend="b12x")`` (what vLLM 0.34's ``FlashInferB12xNvFp4LinearKernel`` runs for
every NVFP4 linear layer) and ``mm_mxfp8(..., backend="b12x")`` build
``Sm120B12xBlockScaledDenseGemmKernel`` through flashinfer's ``_compile_block_scaled_gemm``
without its ``cache_module_name``: compiled in memory on every start, one kernel per tactic
(tile, prefetch, swap) that the default plan or the autotuner asks for. We replace that helper
by name in the two modules whose b12x runners call it (``gemm_base``, and from 0.7.x
``gemm_mm_mxfp8_cute_dsl``); the memo dict a caller passes says which site it is, and every
other caller (the SM100 runners, calls with a ``cache_module_name`` that flashinfer persists
itself) goes to flashinfer's helper untouched.

Site key: flashinfer's in-process ``cache_key`` (the tactic, PDL, output dtype), plus what the
compile depends on that this key leaves out: every other argument of the helper (operand and
scale dtypes, alignment, cluster shape, batch size, ...), the kernel class, and
``max_active_clusters`` (a ``Constexpr`` read from the device, which flashinfer's own disk name
for these kernels carries too). The scale extents ``sf_m``/``sf_n``/``sf_k`` are left out
only when the kernel's ``wrapper`` declares them dynamic integers (checked on the kernel each
time): n and k then do not change the kernel, which is why one kernel serves every layer.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from types import ModuleType
from typing import Any, Callable

from . import _common
from ._common import PATCHES, Call, Site, plain

log = logging.getLogger("cute_diskcache")

GEMM_BASE = "flashinfer.gemm.gemm_base"
MXFP8 = "flashinfer.gemm.gemm_mm_mxfp8_cute_dsl"
HELPER = "_compile_block_scaled_gemm"
#: Site module -> its module-level memo dict -> kind. The dict a caller hands the helper is the
#: site's identity: each b12x runner passes its own.
MEMOS = {
    GEMM_BASE: {"_B12X_MM_FP4_KERNEL_CACHE": "b12x_fp4"},
    MXFP8: {"_B12X_MM_MXFP8_KERNEL_CACHE": "b12x_mxfp8"},
}
#: Arguments of the helper that never reach the key: the memo, the kernel factory (its
#: product is keyed by class and flashinfer's ``cache_key``), and flashinfer's own disk layer.
_NOT_KEYED = {"cache", "cache_key", "make_gemm_kernel", "cache_module_name", "device_index"}
#: Extents the kernel may take as dynamic integers (then left out of the key).
_EXTENTS = ("sf_m", "sf_n", "sf_k")
#: (file relative to flashinfer's package, function) -> kind, for the coverage report.
COVERED = {
    ("gemm/gemm_base.py", "_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward"): "b12x_fp4",
    ("gemm/gemm_mm_mxfp8_cute_dsl.py", "_b12x_gemm_mxfp8_runner.B12xMxfp8GemmRunner.forward"): "b12x_mxfp8",
}


def _key(call: Call) -> Any:
    v = call.locals
    return ("b12x", plain(v["cache_key"]), ("kernel", v["kernel_class"]), ("max_active_clusters", v["max_active_clusters"]),
            ("args", tuple(sorted((name, plain(value)) for name, value in v["args"].items()))),
            ("dynamic", tuple(sorted(v["dynamic"]))))


def _modules(call: Call) -> tuple[str, ...]:
    """The site's module, the helper's (it holds the ``cute.compile`` call) and the kernel's."""
    names = [call.locals["site_module"], call.locals["helper_module"], call.locals["kernel_module"]]
    return tuple(dict.fromkeys(n for n in names if n in sys.modules))


def convention(kernel: Any, _call: Call) -> dict[str, Any]:
    return {"calling_convention": _common.calling_convention(kernel)}


def convention_ok(extra: dict[str, Any]) -> bool:
    return _common.convention_ok(extra.get("calling_convention"))


def as_compiled(kernel: Any, extra: dict[str, Any], _call: Call) -> Any:
    """A hit is the bare tvm-ffi function; flashinfer calls it like the compiled one, leaving
    the kernel's optional trailing arguments out: give it the compiled one's calling convention."""
    return _common.with_calling_convention(kernel, extra["calling_convention"]) if convention_ok(extra) else kernel


def _site(module: str, kind: str) -> Site:
    return Site(module, HELPER, kind, _key, options=lambda call: None, modules=_modules, extra=convention,
                extra_ok=convention_ok, adapt=as_compiled, site_name=f"flashinfer.gemm.{kind}", env_kind="flashinfer-gemm")


def dynamic_extents(kernel: Any) -> set[str]:
    """The scale extents ``kernel.wrapper`` takes as dynamic integers (so they are not codegen).

    An annotation we cannot read as a DSL integer type (a ``Constexpr``, a string annotation,
    a missing parameter) keeps that extent in the key: a miss, never a wrong kernel.
    """
    try:
        import cutlass

        params = inspect.signature(kernel.wrapper).parameters
    except Exception:  # no wrapper, no DSL: every extent stays keyed
        return set()
    out = set()
    for name in _EXTENTS:
        ann = params[name].annotation if name in params else None
        if isinstance(ann, type) and issubclass(ann, cutlass.Integer):
            out.add(name)
    return out


def memo_key(keyed_by_device: bool, args: dict[str, Any]) -> Any:
    """The key flashinfer's helper files a kernel under in the caller's memo dict.

    0.7.x keys per device (``(device_index, cache_key)``; ``device_index`` defaults to the
    current device); 0.6.x by ``cache_key`` alone. Told apart by the helper's signature
    (``keyed_by_device``: it has a ``device_index`` parameter), read once at patch time.
    """
    if not keyed_by_device:
        return args["cache_key"]
    index = args.get("device_index")
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return (index, args["cache_key"])


def _wrapper(real: Callable[..., Any], sites: dict[int, Site], site_module: str) -> Callable[..., Any]:
    """The helper as the site module sees it: the b12x memos go through our cache."""
    signature = inspect.signature(real)
    names = tuple(signature.parameters)
    keyed_by_device = "device_index" in signature.parameters

    @functools.wraps(real)
    def _compile_block_scaled_gemm(*args: Any, **kwargs: Any) -> Any:
        # flashinfer's runners call this on every GEMM: a kernel already in the caller's memo
        # is returned as flashinfer's helper would, before anything is bound or keyed.
        passed = dict(zip(names, args), **kwargs)
        site = sites.get(id(passed.get("cache")))
        if site is None or passed.get("cache_module_name") is not None:
            return real(*args, **kwargs)  # not a b12x site, or one flashinfer persists itself
        memo = passed["cache"]
        if "cache_key" in passed:
            mem_key = memo_key(keyed_by_device, passed)
            if mem_key in memo:
                return memo[mem_key]
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return real(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        mem_key = memo_key(keyed_by_device, given)
        if mem_key in memo:
            return memo[mem_key]
        gemm = given["make_gemm_kernel"]()
        cluster = given["cluster_shape_mn"]
        from flashinfer.cute_dsl.utils import get_max_active_clusters  # what the helper itself reads

        mac = get_max_active_clusters(int(cluster[0]) * int(cluster[1]) * int(given.get("cluster_shape_k", 1) or 1))
        dynamic = dynamic_extents(gemm)
        keyed = {name: value for name, value in given.items() if name not in _NOT_KEYED and name not in dynamic}
        call = Call({"cache_key": given["cache_key"], "args": keyed, "dynamic": dynamic, "max_active_clusters": mac,
                     "kernel_class": f"{type(gemm).__module__}.{type(gemm).__qualname__}",
                     "site_module": site_module, "helper_module": real.__module__, "kernel_module": type(gemm).__module__},
                    (), {})

        def compile_kernel() -> Any:
            # flashinfer's helper, on a private memo, building the kernel object made above.
            private = dict(given, cache={}, make_gemm_kernel=lambda: gemm)
            compiled, _mac = real(**private)
            return compiled

        kernel = _common.through_cache(site, call, compile_kernel)
        # flashinfer memoises what its helper returned, a planned kernel too (a planning process
        # never serves): a later call for the same tactic then asks for nothing, as on the card.
        result = memo[mem_key] = (kernel, mac)
        return result

    _compile_block_scaled_gemm._cdc_gemm = True  # type: ignore[attr-defined]
    return _compile_block_scaled_gemm


def patch(module: ModuleType) -> bool:
    """Route ``module``'s b12x GEMM compiles through the cache (idempotent); True if it has any."""
    memos = MEMOS.get(module.__name__)
    return bool(memos) and PATCHES.replace(module, HELPER, "_cdc_gemm", lambda real: _wrap(module, real, memos))


def _wrap(module: ModuleType, real: Any, memos: dict[str, str]) -> Callable[..., Any] | None:
    """Our wrapper around ``module``'s compile helper, or None when it is not the helper we know."""
    sites = {id(module.__dict__[name]): _site(module.__name__, kind)
             for name, kind in memos.items() if isinstance(module.__dict__.get(name), dict)}
    if not callable(real) or not sites:
        return None
    params = inspect.signature(real).parameters
    if not {"cache", "cache_key", "make_gemm_kernel", "cluster_shape_mn"} <= set(params):
        log.warning("flashinfer %s: %s.%s has another signature; b12x GEMMs stay uncached",
                    _common.flashinfer_version(), module.__name__, HELPER)
        return None
    return _wrapper(real, sites, module.__name__)


def unpatch(module: ModuleType) -> None:
    if module.__name__ in MEMOS:
        PATCHES.restore(module, (HELPER,))
