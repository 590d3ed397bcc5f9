"""The flashinfer adapter: the only module that knows how flashinfer compiles its sm12x MoE kernels.

flashinfer 0.6.12-0.6.17 ``moe_dispatch`` compiles its static, micro and dynamic kernels with
``cute.compile(...)`` inside ``_get_static_kernel`` / ``_get_micro_kernel`` /
``_get_dynamic_kernel``, after computing an exact in-process ``cache_key`` tuple. We replace the
``cute`` name *inside that module only* with a proxy whose ``compile`` looks at its caller: at a
known site it takes that ``cache_key`` from the frame and goes through the disk cache; any other
caller gets the real ``cute.compile`` untouched. moe_dispatch then stores whatever we return in
its own ``_*_KERNEL_CACHE`` dicts, so its in-process behaviour is unchanged.

flashinfer >= 0.6.18 persists these three kernels itself (``flashinfer/jit/cute_dsl_core.py``);
there the proxy is still installed but every call passes through, so the two caches never hold
the same kernel.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Any

from . import targets
from .cache import CompileCache, default_cache
from .key import CacheKey, Environment, UnkeyableError, current_arch, source_fingerprint

log = logging.getLogger("cute_diskcache")

MOE_DISPATCH = "flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch"
FLASHINFER_UTILS = "flashinfer.cute_dsl.utils"

#: site function in moe_dispatch -> kernel kind. Valid for 0.6.12 <= flashinfer < 0.6.18.
SITES = {
    "_get_static_kernel": "static",
    "_get_micro_kernel": "micro",
    "_get_dynamic_kernel": "dynamic",
}
FIRST_NATIVE = (0, 6, 18)  # flashinfer caches these sites on disk itself from here on
FIRST_SUPPORTED = (0, 6, 12)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits or not piece[0].isdigit():
            break
        parts.append(int(digits))
    return tuple(parts)


def flashinfer_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get("flashinfer")
        return str(getattr(mod, "__version__", "0+unknown"))


def coverage(md: ModuleType, version: str) -> dict[str, str]:
    """For each known site: 'cute-diskcache', 'flashinfer' (native disk cache) or 'absent'."""
    native = _version_tuple(version)[:3] >= FIRST_NATIVE or hasattr(md, "build_and_load_cute_dsl_kernel")
    out = {}
    for fn_name in SITES:
        if not hasattr(md, fn_name):
            out[fn_name] = "absent"
        elif native:
            out[fn_name] = "flashinfer"
        else:
            out[fn_name] = "cute-diskcache"
    return out


class _Compile:
    """``cute.compile`` as moe_dispatch sees it: sites go through the cache, the rest pass."""

    def __init__(self, real: Any, sites: dict[Any, str], env_fn: Any, cache_fn: Any) -> None:
        self._real = real
        self._sites = sites  # code object -> kernel kind
        self._env_fn = env_fn
        self._cache_fn = cache_fn

    def __getitem__(self, options: Any) -> Any:
        # cute.compile[OptLevel(3)](...) form: not used by the 0.6.x sites; pass through.
        return self._real[options]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        kind = self._sites.get(frame.f_code)
        site_key = frame.f_locals.get("cache_key") if kind is not None else None
        del frame
        if kind is None or site_key is None:
            return self._real(*args, **kwargs)
        try:
            key = CacheKey(self._env_fn(), f"flashinfer.moe_dispatch.{kind}", site_key, kwargs.get("options"))
            key.digest  # noqa: B018 - encode now, so an unkeyable element is caught here
        except UnkeyableError as exc:
            log.warning("not caching %s kernel: %s", kind, exc)
            return self._real(*args, **kwargs)
        cache: CompileCache = self._cache_fn()
        kernel, _extra = cache.get_or_compile(key, lambda: self._real(*args, **kwargs))
        return kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _CuteProxy(ModuleType):
    """A stand-in for ``cutlass.cute`` inside moe_dispatch only; everything but compile delegates."""

    def __init__(self, real: ModuleType, compile_: _Compile) -> None:
        super().__init__(real.__name__)
        self.__dict__["_cdc_real"] = real
        self.__dict__["compile"] = compile_

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_cdc_real"], name)


_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _environment(md_name: str) -> Environment:
    md = sys.modules[md_name]
    return Environment(
        kind="flashinfer-moe",
        package=f"flashinfer-python=={flashinfer_version()}",
        sources=source_fingerprint(md, "flashinfer"),
        arch=current_arch(),
    )


def patch(md: ModuleType) -> bool:
    """Install the proxy into moe_dispatch (idempotent). True when its sites now use our cache."""
    with _lock:
        if isinstance(md.__dict__.get("cute"), _CuteProxy):
            return _covered(md)
        _apply_profile_to_flashinfer(md)
        real = md.__dict__.get("cute")
        if real is None:
            log.debug("moe_dispatch has no 'cute' global; nothing to patch")
            return False
        covered = _covered(md)
        sites = {getattr(md, fn).__code__: kind for fn, kind in SITES.items() if covered and hasattr(md, fn)}
        proxy = _CuteProxy(real, _Compile(real.compile, sites, lambda: _environment(md.__name__), default_cache))
        md.cute = proxy
        if covered:
            log.debug("cute-diskcache covers moe_dispatch sites %s", ", ".join(SITES))
        else:
            log.debug("flashinfer %s: moe_dispatch sites left to flashinfer", flashinfer_version())
        return covered


def _covered(md: ModuleType) -> bool:
    version = flashinfer_version()
    if _version_tuple(version)[:3] < FIRST_SUPPORTED:
        return False
    return any(v == "cute-diskcache" for v in coverage(md, version).values())


def unpatch(md: ModuleType) -> None:
    with _lock:
        proxy = md.__dict__.get("cute")
        if isinstance(proxy, _CuteProxy):
            md.cute = proxy.__dict__["_cdc_real"]


def _apply_profile_to_flashinfer(md: ModuleType) -> None:
    """With a target profile, answer flashinfer's max-active-clusters probe from the profile.

    The DSL's probe launches an occupancy query on the driver, which a box without the card
    cannot answer; flashinfer would then warn and fall back to the SM count.
    """
    profile = targets.active()
    if profile is None:
        return

    def get_max_active_clusters(cluster_size: int) -> int:
        return profile.max_active_clusters(cluster_size)

    utils = sys.modules.get(FLASHINFER_UTILS)
    for mod in (utils, md):
        if mod is not None and hasattr(mod, "get_max_active_clusters"):
            mod.get_max_active_clusters = get_max_active_clusters
