"""Owns one kernel, one cache for b12x: its disk layer stands aside while ours serves b12x's compiles.

b12x's ``compile()`` reads its own disk cache before it compiles and writes it after, keyed with
torch's build, ``torch.version.cuda`` and the device's arch (an entry written on a CPU build box
never hits on the GPU box), and verifies bytes but not trust, ownership or host. Its wrapper calls
``cute.compile`` itself, so the hook meets every b12x miss; standing aside is therefore only
replacing the four functions of :data:`.sites.NATIVE_LAYER` in ``b12x._lib.compiler`` (looked up by
global name at call time), recorded in :data:`~..core.patches.PATCHES` so :func:`unpatch` restores them.
A compile then reaches the hook, which hits ours or compiles and commits.

b12x's switches keep their meaning: ``B12X_COMPILE_DISK_CACHE=0`` turns b12x's layer off (ours
still serves: ``FLASHINFER_B12X_DISK_CACHE`` turns ours on); its memory cache and its logs are
untouched. With ``CUTE_DISKCACHE_NATIVE_SITES`` naming b12x nothing is replaced (the hook hands
b12x's compiles back: :mod:`.adapter`). flashinfer's embedded copy is never touched (flashinfer's).
"""

from __future__ import annotations

import contextlib
import logging
import os
from types import ModuleType
from typing import Any

from ..core.patches import PATCHES
from . import adapter, sites

log = logging.getLogger("cute_diskcache")
_MARKER = "_cdc_b12x_aside"


def _no_load(cache_key: str) -> None:
    return None


def _no_store(*_args: Any, **_kwargs: Any) -> None:
    return None


def _no_lock(cache_key: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


_STAND_INS = {
    "_load_cute_compile_from_disk": _no_load,
    "_store_cute_compile_to_disk": _no_store,
    "_ensure_cute_compile_manifest": _no_store,
    "_disk_cache_key_lock": _no_lock,
}
for _fn in _STAND_INS.values():
    setattr(_fn, _MARKER, True)


def standalone(module: ModuleType) -> bool:
    """Whether ``module`` is the standalone b12x's (not flashinfer's embedded copy under the alias)."""
    root = adapter.package_dir()
    path = getattr(module, "__file__", None)
    return bool(root and path and os.path.realpath(path).startswith(root + os.sep))


def patch(module: ModuleType) -> bool:
    """Stand b12x's disk layer aside in ``b12x._lib.compiler`` (idempotent); True when it stands aside."""
    if adapter.left_to_b12x() or not standalone(module):
        return False
    missing = [name for name in sites.NATIVE_LAYER if not callable(getattr(module, name, None))]
    if missing:  # a b12x release that reworked its disk layer: leave it whole (two copies, never a wrong kernel)
        log.warning("cute-diskcache: b12x %s has no %s; its own disk cache stays on beside ours",
                    adapter.version(), ", ".join(missing))
        return False
    for name in sites.NATIVE_LAYER:
        PATCHES.replace(module, name, _MARKER, lambda _real, name=name: _STAND_INS[name])
    return True


def unpatch(module: ModuleType) -> None:
    """Put b12x's disk layer back."""
    PATCHES.restore(module, sites.NATIVE_LAYER)


def standing_aside(module: ModuleType) -> bool:
    """Whether b12x's disk layer in ``module`` is ours now (for ``doctor`` and tests)."""
    return all(getattr(getattr(module, name, None), _MARKER, False) for name in sites.NATIVE_LAYER)
