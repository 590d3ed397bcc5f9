"""flashinfer 0.6.12-0.6.17: moe_dispatch's static, micro and dynamic kernels.

``moe_dispatch`` compiles them with ``cute.compile(...)`` inside ``_get_static_kernel`` /
``_get_micro_kernel`` / ``_get_dynamic_kernel``, right after computing an exact in-process
``cache_key`` tuple: that tuple, read from the frame, is the site key.

From 0.6.18 on flashinfer persists these three kernels itself (``flashinfer/jit/cute_dsl_core.py``);
there the proxy is still installed but every call passes through, so the two caches never hold
the same kernel (:mod:`.v0_7` covers what that generation leaves in memory).
"""

from __future__ import annotations

import logging
from types import ModuleType

from . import compat
from ._common import MOE_DISPATCH, PATCHES, Call, Site, install_proxy, site_codes, version_tuple, flashinfer_version

log = logging.getLogger("cute_diskcache")

#: site function in moe_dispatch -> kernel kind.
SITES = {
    "_get_static_kernel": "static",
    "_get_micro_kernel": "micro",
    "_get_dynamic_kernel": "dynamic",
}
FIRST_SUPPORTED = (0, 6, 12)
FIRST_NATIVE = (0, 6, 18)  # flashinfer caches these sites on disk itself from here on
#: Releases of this generation the compatibility matrix proved (see :mod:`.compat`).
VERIFIED = tuple(v for v in compat.VERIFIED if FIRST_SUPPORTED <= version_tuple(v)[:3] < FIRST_NATIVE)
#: (file relative to blackwell_sm12x/, function) -> kind, for the coverage report.
COVERED = {("moe_dispatch.py", fn): kind for fn, kind in SITES.items()}
#: What the sites rely on in flashinfer's source, checked on releases outside VERIFIED: each
#: reads flashinfer's in-process ``cache_key`` and calls ``cute.compile(..., options=...)``.
SHAPES = {MOE_DISPATCH: {fn: compat.shape(("cache_key",), cute_compile={"options"}) for fn in SITES}}


def _site_key(call: Call) -> object:
    return call.locals["cache_key"]


def _sites() -> list[Site]:
    return [
        Site(MOE_DISPATCH, fn, kind, _site_key, site_name=f"flashinfer.moe_dispatch.{kind}")
        for fn, kind in SITES.items()
    ]


def applies(version: str) -> bool:
    return FIRST_SUPPORTED <= version_tuple(version)[:3] < FIRST_NATIVE


def coverage(md: ModuleType, version: str) -> dict[str, str]:
    """For each 0.6 site: 'cute-diskcache', 'flashinfer' (native disk cache) or 'absent'."""
    native = version_tuple(version)[:3] >= FIRST_NATIVE or hasattr(md, "build_and_load_cute_dsl_kernel")
    out = {}
    for fn_name in SITES:
        if not hasattr(md, fn_name):
            out[fn_name] = "absent"
        elif native:
            out[fn_name] = "flashinfer"
        else:
            out[fn_name] = "cute-diskcache"
    return out


def covered(md: ModuleType) -> bool:
    version = flashinfer_version()
    if version_tuple(version)[:3] < FIRST_SUPPORTED:
        return False
    return any(v == "cute-diskcache" for v in coverage(md, version).values())


def patch(md: ModuleType) -> bool:
    """Install the proxy into moe_dispatch (idempotent). True when its sites now use our cache."""
    with PATCHES.lock:
        is_covered = covered(md)
        if is_covered:
            keep = compat.vetted(md, SITES, SHAPES[MOE_DISPATCH])  # all of them on a verified release
            sites = site_codes(md, [s for s in _sites() if s.function in keep])
        else:
            sites = {}
        if not install_proxy(md, sites):
            log.debug("moe_dispatch has no 'cute' global; nothing to patch")
            return False
        if sites:
            _warm_up(md)
            log.debug("cute-diskcache covers moe_dispatch sites %s", ", ".join(s.function for s in sites.values()))
        else:
            log.debug("flashinfer %s: moe_dispatch sites left to flashinfer", flashinfer_version())
        return bool(sites)


def _warm_up(md: ModuleType) -> None:
    """Do the once-per-process work now, at engine start, instead of on the first request.

    The kernel sources' fingerprint (hashing moe_dispatch and what it reaches) and the cache's
    own warm-up (:meth:`~..cache.CompileCache.warm_up`).
    """
    from ..cache import default_cache
    from ._common import site_sources

    try:
        site_sources(md.__name__)
        default_cache().warm_up()
    except Exception as exc:  # only an optimisation; the first compile site retries
        log.debug("warm-up skipped: %s", exc)
