"""The flashinfer adapter: the only code that knows how flashinfer compiles its sm12x MoE kernels.

One module per flashinfer generation:

* :mod:`.v0_6` - 0.6.12 to 0.6.17: moe_dispatch's static, micro and dynamic kernels, which
  flashinfer keeps in memory only.
* :mod:`.gemm` - every release: the b12x dense FP4 and MXFP8 GEMMs (SM120/SM121), which
  flashinfer compiles in memory only (:mod:`.gemm_offline`: what their public API asks of a
  card that is not in the machine).
* :mod:`.getters` - every release that has them: kernel getters whose arguments determine the
  kernel (the BF16 x FP4 dense GEMM and its m=1 GEMV, W4A16 NVFP4 linear layers; MSA's top-k,
  combine and union kernels), in memory only in flashinfer.
* :mod:`.inline` - every release that has them: sm12x kernels compiled inside an op or a
  kernel runner (MSA, block-sparse attention, KDA, GDN, frost low-latency, expert-parallel MoE),
  keyed by everything the compile receives.
* :mod:`.native` - 0.6.18+: flashinfer's other natively cached sm12x kernels (SM12x CuTe FP4
  GEMM, SM120 FMHA), served like moe_dispatch's.
* :mod:`.v0_7` - 0.6.18 to 0.7.x: flashinfer persists those three itself, keyed on torch's
  build; we serve them from our cache instead (``CUTE_DISKCACHE_NATIVE_SITES=flashinfer`` leaves
  them to flashinfer; either way one kernel never has two caches), and cover the sites it still
  leaves in memory (direct micro kernel, W4A16 compiler, nvfp4 W4A4/W4A16 runners, fp8 and
  mxfp8 op modules).

:mod:`.compat` holds what the compatibility matrix proved: the verified releases, the
flashinfer + DSL combinations refused, and the checks a site passes before it is cached on a
release outside the verified list.

The activation hook hands us every module under :data:`.names.SITE_PACKAGES` as it is imported
(:func:`patch`, :func:`apply_profile`); whatever we do not know is left alone.
:func:`coverage_report` says, from the installed source, which sites are covered by whom.
"""

from __future__ import annotations

import sys

from .names import FLASHINFER_UTILS, MOE_DISPATCH, SM12X

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
    "planning": "_common",
    "planned_requests": "_common",
    "FIRST_NATIVE": "v0_6",
    "FIRST_SUPPORTED": "v0_6",
    "SITES": "v0_6",
    "coverage": "v0_6",
}

__all__ = [
    "FLASHINFER_UTILS",
    "MOE_DISPATCH",
    "SM12X",
    *_LAZY,
    "apply_profile",
    "attach_dsl",
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
    """Attach the disk cache to one flashinfer module (idempotent). True if sites there use it.

    A flashinfer + DSL combination the compatibility matrix shows cannot work is refused
    (:mod:`.compat`): nothing is attached, and one log line says why.
    """
    from . import compat, gemm, getters, native, v0_6, v0_7
    from ._common import flashinfer_version

    if compat.refused():
        return False
    if module.__name__ in gemm.MEMOS:
        return gemm.patch(module)  # the b12x dense GEMMs (every release that has them)
    if module.__name__ in getters.MODULES:
        return getters.patch(module)  # the kernel getters: BF16 x FP4 GEMM and GEMV, MSA (every release that has them)
    if module.__name__ == native.CORE:
        return v0_7.applies(flashinfer_version()) and native.patch(module)
    version = flashinfer_version()
    if module.__name__ == MOE_DISPATCH and not v0_7.applies(version):
        return v0_6.patch(module)  # below 0.6.12 it installs a proxy that passes everything
    if v0_7.applies(version):
        return v0_7.patch(module)
    return False


def attach_dsl() -> bool:
    """Route flashinfer's inline sites through the cache: one hook on ``cutlass.cute.compile``,
    put in place as the DSL is imported (those sites' modules import it inside functions, or are
    imported under names outside ``flashinfer.*``, so no flashinfer import announces them)."""
    from . import compat, inline

    return not compat.refused() and inline.patch()


def unpatch(module: ModuleType) -> None:
    """Put back what :func:`patch` replaced in ``module`` (target profile stand-ins stay)."""
    from . import gemm, getters, native, v0_7

    v0_7.unpatch(module)
    gemm.unpatch(module)
    getters.unpatch(module)
    native.unpatch(module)


def apply_profile(module: ModuleType) -> None:
    """With a target profile active, answer ``module``'s device queries from the profile.

    The DSL's max-active-clusters probe launches an occupancy query on the driver, which a box
    without the card cannot answer (flashinfer would warn and fall back to the SM count); the
    DSL's own driver attribute queries are answered from the profile (:mod:`..devicefacts`);
    the 0.6.18+ sites ask more (see :func:`.v0_7.apply_profile`).
    """
    from .. import devicefacts, targets
    from . import gemm_offline, v0_7
    from ._common import flashinfer_version

    profile = targets.active()
    if profile is None:
        return

    def get_max_active_clusters(cluster_size: int) -> int:
        return profile.max_active_clusters(cluster_size)

    for mod in (sys.modules.get(FLASHINFER_UTILS), module):
        if mod is not None and hasattr(mod, "get_max_active_clusters"):
            mod.get_max_active_clusters = get_max_active_clusters
    devicefacts.install_hook()  # the DSL bakes some driver answers into the IR
    gemm_offline.apply(module, profile)  # what the GEMM API asks of the device
    if v0_7.applies(flashinfer_version()):
        v0_7.apply_profile(module, profile)
