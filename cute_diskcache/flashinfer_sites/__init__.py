"""The flashinfer adapter: the only code that knows how flashinfer compiles its sm12x MoE kernels.

One module per flashinfer generation:

* :mod:`.v0_6` - 0.6.12 to 0.6.17: moe_dispatch's static, micro and dynamic kernels, which
  flashinfer keeps in memory only.
* :mod:`.v0_7` - 0.6.18 to 0.7.x: flashinfer persists those three itself, keyed on torch's
  build; we serve them from our cache instead (``CUTE_DISKCACHE_NATIVE_SITES=flashinfer`` leaves
  them to flashinfer; either way one kernel never has two caches), and cover the sites it still
  leaves in memory (direct micro kernel, W4A16 compiler, nvfp4 W4A4/W4A16 runners, fp8 and
  mxfp8 op modules).

:mod:`.compat` holds what the compatibility matrix proved: the verified releases, the
flashinfer + DSL combinations refused, and the checks a site passes before it is cached on a
release outside the verified list.

The activation hook hands us every module under ``fused_moe/cute_dsl/blackwell_sm12x`` as it
is imported (:func:`patch`, :func:`apply_profile`); whatever we do not know is left alone.
:func:`coverage_report` says, from the installed source, which sites are covered by whom.
"""

from __future__ import annotations

import sys
from types import ModuleType

from .. import targets
from . import compat, v0_6, v0_7
from ._common import (
    FLASHINFER_UTILS,
    MOE_DISPATCH,
    SM12X,
    _Compile,
    _CuteProxy,
    flashinfer_version,
    planning,
)
from ._common import version_tuple as _version_tuple
from .scan import coverage_report
from .driving import Dispatcher, dispatch, kernel_cache_sizes
from .v0_6 import FIRST_NATIVE, FIRST_SUPPORTED, SITES, coverage

__all__ = [
    "compat",
    "FIRST_NATIVE",
    "FIRST_SUPPORTED",
    "FLASHINFER_UTILS",
    "MOE_DISPATCH",
    "SITES",
    "_Compile",
    "_CuteProxy",
    "_version_tuple",
    "SM12X",
    "Dispatcher",
    "apply_profile",
    "coverage",
    "coverage_report",
    "dispatch",
    "flashinfer_version",
    "kernel_cache_sizes",
    "patch",
    "planning",
    "unpatch",
]


def patch(module: ModuleType) -> bool:
    """Attach the disk cache to one flashinfer module (idempotent). True if sites there use it.

    A flashinfer + DSL combination the compatibility matrix shows cannot work is refused
    (:mod:`.compat`): nothing is attached, and one log line says why.
    """
    if compat.refused():
        return False
    version = flashinfer_version()
    if module.__name__ == MOE_DISPATCH and not v0_7.applies(version):
        return v0_6.patch(module)  # below 0.6.12 it installs a proxy that passes everything
    if v0_7.applies(version):
        return v0_7.patch(module)
    return False


def unpatch(module: ModuleType) -> None:
    """Put back what :func:`patch` replaced in ``module`` (target profile stand-ins stay)."""
    v0_7.unpatch(module)


def apply_profile(module: ModuleType) -> None:
    """With a target profile active, answer ``module``'s device queries from the profile.

    The DSL's max-active-clusters probe launches an occupancy query on the driver, which a box
    without the card cannot answer (flashinfer would warn and fall back to the SM count); the
    0.6.18+ sites ask more (see :func:`.v0_7.apply_profile`).
    """
    profile = targets.active()
    if profile is None:
        return

    def get_max_active_clusters(cluster_size: int) -> int:
        return profile.max_active_clusters(cluster_size)

    for mod in (sys.modules.get(FLASHINFER_UTILS), module):
        if mod is not None and hasattr(mod, "get_max_active_clusters"):
            mod.get_max_active_clusters = get_max_active_clusters
    targets.apply_driver_attributes(profile)  # the DSL bakes some driver answers into the IR
    if v0_7.applies(flashinfer_version()):
        v0_7.apply_profile(module, profile)
