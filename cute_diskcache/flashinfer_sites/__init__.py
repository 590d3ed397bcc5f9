"""The flashinfer adapter: the only code that knows how flashinfer compiles its sm12x kernels.

One mechanism covers every release: :mod:`..core.hook` replaces the DSL's ``cutlass.cute.compile`` once
(the library-neutral activation layer puts it there), and a compile reached from a site listed in :mod:`.sites` (a table: where, which kind, what side
data) goes through the cache, keyed by everything the compile receives. The one exception,
:mod:`.native`, stands in front of flashinfer's own disk cache (0.6.18+) for the sites it builds
through it, so that those compiles reach the hook at all. Beside them:

* :mod:`.block_dim` - side data: the direct micro kernel's launch probe answer;
* :mod:`.offline` and :mod:`.gemm_offline` - a target profile's answers to flashinfer's device queries;
* :mod:`.compat` - what the compatibility matrix proved (verified releases, refused combinations);
* :mod:`.scan` - the site scan behind ``doctor`` (:func:`coverage_report`), with :mod:`.known`;
* :mod:`.driving`, :mod:`.functional`, :mod:`.dense` - prewarm's drivers of flashinfer's own dispatch;
* :mod:`._common` - flashinfer's version and the variables of flashinfer's that change no code.

The path every compile takes (``Site``, ``through_cache``, planning) is library-neutral:
:mod:`..core.through`.

The activation hook hands us every module under :data:`.names.SITE_PACKAGES` as it is imported
(:func:`patch`, :func:`apply_profile`), and asks before the hook goes on the DSL (:func:`admits_dsl`).
"""

from __future__ import annotations

from .names import FLASHINFER, FLASHINFER_UTILS, MOE_DISPATCH, SM12X

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook loads this at start-up)
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

#: Public name -> the submodule that defines it. Loaded on first use: the activation hook imports
#: :mod:`.names` at interpreter start, which must not pull in the cache, torch or the DSL.
_LAZY = {
    "compat": None,
    "Dispatcher": "driving",
    "dispatch": "driving",
    "import_dispatch": "driving",
    "kernel_cache_sizes": "driving",
    "coverage_report": "scan",
    "flashinfer_version": "_common",
}

__all__ = [
    "FLASHINFER_UTILS",
    "MOE_DISPATCH",
    "SM12X",
    *_LAZY,
    "admits_dsl",
    "apply_profile",
    "patch",
    "unpatch",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    return module if _LAZY[name] is None else getattr(module, name)


def patch(module: ModuleType) -> bool:
    """Attach to one flashinfer module as it is imported (idempotent). True if we stand in it.

    Every compile goes through the hook on ``cutlass.cute.compile``; a module needs more only where
    flashinfer's native builder sits (:mod:`.native`) or moe_dispatch probes its kernels
    (:mod:`.block_dim`). A flashinfer + DSL combination the compatibility matrix shows cannot
    work is refused (:mod:`.compat`): nothing is attached, and one log line says why.
    """
    from . import block_dim, compat, native

    if compat.refused():
        return False
    if module.__name__ == MOE_DISPATCH:
        block_dim.patch(module)
        _warm_up(module)
    return native.patch(module)


def _warm_up(md: ModuleType) -> None:
    """Do the once-per-process work at engine start, not on the first request: the kernel
    sources' fingerprint and the cache's own warm-up (:meth:`~..core.cache.CompileCache.warm_up`)."""
    import logging

    from ..core.cache import default_cache
    from ..core.through import site_sources

    try:
        site_sources(md.__name__, "flashinfer")  # as the hook asks it (its adapter's module)
        default_cache().warm_up()
    except Exception as exc:  # noqa: BLE001 - only an optimisation; the first compile retries
        logging.getLogger("cute_diskcache").debug("warm-up skipped: %s", exc)


def admits_dsl() -> bool:
    """Whether the library-neutral hook may go on ``cutlass.cute.compile`` as far as flashinfer is
    concerned: not with a flashinfer + DSL combination the compatibility matrix refused (one log
    line says why); an unverified release is said once. Without flashinfer, nothing to say."""
    import importlib.util

    from . import compat

    if importlib.util.find_spec(FLASHINFER) is None:
        return True
    if compat.refused():
        return False
    compat.note_unverified()
    return True


def unpatch(module: ModuleType) -> None:
    """Put back what :func:`patch` replaced in ``module`` (target profile stand-ins stay)."""
    from . import block_dim, native

    native.unpatch(module)
    if module.__name__ == MOE_DISPATCH:
        block_dim.unpatch(module)


def apply_profile(module: ModuleType) -> None:
    """With a target profile active, answer ``module``'s device queries from it (:mod:`.offline`)."""
    from .offline import apply_profile as apply

    apply(module)
