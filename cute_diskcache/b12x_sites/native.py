"""Owns one kernel, one cache for b12x: its disk layer stands aside while ours serves b12x's compiles.

b12x's ``compile()`` reads its own disk cache before it compiles and writes it after, keyed with
torch's build, ``torch.version.cuda`` and the device's arch (an entry written on a CPU build box
never hits on the GPU box), and verifies bytes but not trust, ownership or host. Its wrapper calls
``cute.compile`` itself, so the hook meets every b12x miss; standing aside is therefore only
replacing the four functions of :data:`.sites.NATIVE_LAYER` in ``b12x._lib.compiler`` (looked up by
global name at call time), recorded in :data:`~..core.patches.PATCHES` so :func:`unpatch` restores them.
A compile then reaches the hook, which hits ours or compiles and commits.

Where b12x passes kernels between processes through its disk layer, the layer stays b12x's:
a compile worker of b12x's ``CompilePool`` (``_OFFLINE_CUTE_NO_JIT`` set; our prewarm workers,
which set it too, excluded by :func:`keep_store_aside`) still compiles through the hook, then stores
into b12x's disk (under b12x's lock), the only place its parent looks
(``compile_plan.compiled_program_available``); inside b12x's ``no_compilation()`` (lowering
forbidden) a load is b12x's own, the only path b12x allows there. Standing aside there made
``PreparationSession(compile_workers>0)`` fail ("compiler completed without publishing required
artifacts"); vLLM 0.34's lazy, in-process b12x path meets neither flow.

One voice: b12x counts a compile miss, and with ``B12X_LOG_CUTE_COMPILES`` prints a
"disk-cache-miss" line, before it calls the wrapper, so a kernel ours served read as compiled in
the engine's log. Its miss line is held (``_log_cute_compile_miss`` for that status) until the
store that follows the wrapper: if ours served the kernel (our cache's events since b12x's last
load say so), the line is dropped and b12x's books are put right (one miss less, one disk hit
more, as for a kernel its own disk layer loaded); if it compiled, the line is printed then.

b12x's switches keep their meaning: ``B12X_COMPILE_DISK_CACHE=0`` turns b12x's layer off (ours
still serves: ``FLASHINFER_B12X_DISK_CACHE`` turns ours on); its memory cache and its logs are
untouched. With ``CUTE_DISKCACHE_NATIVE_SITES`` naming b12x nothing is replaced (the hook hands
b12x's compiles back: :mod:`.adapter`). flashinfer's embedded copy is never touched (flashinfer's).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from types import ModuleType
from typing import Any

from ..core.patches import PATCHES
from ..storage.counting import NOT_SERVED
from . import adapter, names, sites

log = logging.getLogger("cute_diskcache")
_MARKER = "_cdc_b12x_aside"


#: Set in our own prewarm workers (:func:`keep_store_aside`), which b12x's worker set-up marks as
#: its compile workers too: they publish to our cache only.
_store_aside_always = False


def keep_store_aside() -> None:
    """This process runs b12x's worker set-up only to compile without a GPU (a prewarm worker of
    ours, a test's stand-in for an engine), not as a worker of b12x's pool: never store into b12x's disk."""
    global _store_aside_always
    _store_aside_always = True


def _publishes(module: ModuleType) -> bool:
    """A compile worker of b12x's own pool: its parent finds its kernels only in b12x's disk."""
    return bool(getattr(module, "_OFFLINE_CUTE_NO_JIT", False)) and not _store_aside_always


def _lowering_forbidden() -> bool:
    """Inside b12x's ``no_compilation()``: only b12x's own loads may resolve a kernel."""
    plan = sys.modules.get(names.COMPILE_PLAN)
    flag = getattr(plan, "_FORBID_LOWERING", None)
    try:
        return bool(flag.get()) if flag is not None else False
    except Exception:  # noqa: BLE001 - a b12x whose flag is no ContextVar: not a phase we know
        return False


_pending = threading.local()  # per thread: our cache's event count at b12x's last load, its held miss line


def _tally() -> Any:
    from ..core.cache import default_cache

    return default_cache().tally


def _settle(module: ModuleType) -> None:
    """After b12x's wrapper returned: a kernel ours served is b12x's disk hit, not its compile miss."""
    mark, held = getattr(_pending, "mark", None), getattr(_pending, "held", None)
    _pending.mark = _pending.held = None
    if mark is None:
        return
    outcomes = {event.outcome for event in _tally().since(mark)}
    if outcomes and not outcomes & {"miss", *NOT_SERVED}:
        with module._MEMORY_CACHE_LOCK:
            module._COMPILE_MISSES -= 1
            module._DISK_CACHE_HITS += 1
    elif held is not None:
        real, args, kwargs = held
        real(*args, **kwargs)


def _stand_in(name: str, real: Any, module: ModuleType) -> Any:
    """b12x's ``name`` while ours serves: a no-op, but b12x's own in the two flows of the module docstring."""
    if name == "_load_cute_compile_from_disk":
        def load(cache_key: str) -> Any:
            if _lowering_forbidden():
                return real(cache_key)
            _pending.mark, _pending.held = _tally().mark(), None
            return None
        fn: Any = load
    elif name == "_log_cute_compile_miss":
        def log_miss(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("cache_status") == "disk-cache-miss" and getattr(_pending, "mark", None) is not None:
                _pending.held = (real, args, kwargs)
                return None
            return real(*args, **kwargs)
        fn = log_miss
    elif name == "_disk_cache_key_lock":
        def lock(cache_key: str) -> contextlib.AbstractContextManager[Any]:
            return real(cache_key) if _publishes(module) else contextlib.nullcontext()
        fn = lock
    else:  # the store and the manifest: written where the parent reads them
        def write(*args: Any, **kwargs: Any) -> Any:
            if name == "_store_cute_compile_to_disk":
                _settle(module)
            if _publishes(module) or (name == "_ensure_cute_compile_manifest" and _lowering_forbidden()):
                return real(*args, **kwargs)
            return None
        fn = write
    setattr(fn, _MARKER, True)
    fn.__name__ = fn.__qualname__ = f"cute_diskcache_{name.strip('_')}"
    return fn


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
        PATCHES.replace(module, name, _MARKER, lambda real, name=name: _stand_in(name, real, module))
    return True


def unpatch(module: ModuleType) -> None:
    """Put b12x's disk layer back."""
    PATCHES.restore(module, sites.NATIVE_LAYER)


def standing_aside(module: ModuleType) -> bool:
    """Whether b12x's disk layer in ``module`` is ours now (for ``doctor`` and tests)."""
    return all(getattr(getattr(module, name, None), _MARKER, False) for name in sites.NATIVE_LAYER)
