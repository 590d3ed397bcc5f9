"""Owns one kernel, one cache for SGLang's FA4 kernels: SGLang's ``cute_aot`` cache stands aside.

SGLang's FA4 interface keeps its compiled kernels in ``JITPersistentCache`` objects
(``kernels/jit/cute_aot_cache.py``), hung on the interface's functions at import
(``_flash_attn_fwd.compile_cache`` ...). Their membership test reads SGLang's directory before
anything compiles (``{SGLANG_CUTE_AOT_CACHE_DIR}/<fingerprint>/fwd/<sha256>.o``) and links
whatever object file is there into the process, unchecked: a planted or foreign file is run as
the kernel. While ours serves, each of them is replaced, as the interface is imported, by
SGLang's own in-memory ``JITCache`` (the class its ``get_jit_cache`` returns when the variable is
empty): a miss in memory then reaches ``cute.compile``, where the hook hits ours or compiles and
commits, and SGLang's directory is neither read nor written for these kernels. SGLang's files
on disk are never edited; its other persistent caches (the shear-bias kernels, the KDA decode)
are untouched. ``CUTE_DISKCACHE_NATIVE_SITES=sglang`` leaves them all to SGLang.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

from . import adapter, sites

log = logging.getLogger("cute_diskcache")
AOT_MODULE = "sglang.kernels.jit.cute_aot_cache"
_MARKER = "_cdc_sglang_aside"
#: (module name, function name, attribute) -> SGLang's persistent cache we replaced.
_SAVED: dict[tuple[str, str, str], Any] = {}


def _in_memory(persistent: Any, aot: ModuleType) -> Any:
    """SGLang's in-memory cache holding what ``persistent`` already holds in memory."""
    cache = aot.JITCache()
    cache.cache.update(getattr(persistent, "cache", {}))
    setattr(cache, _MARKER, True)
    return cache


def patch(module: ModuleType) -> bool:
    """Stand SGLang's persistent FA4 caches aside in the interface (idempotent); True when they stand aside."""
    if adapter.left_to_sglang():
        return False
    aot = sys.modules.get(AOT_MODULE)
    persistent_type = getattr(aot, "JITPersistentCache", None)
    if aot is None or persistent_type is None or not hasattr(aot, "JITCache"):
        log.warning("cute-diskcache: SGLang %s has no %s.JITPersistentCache; its FA4 cache stays on beside ours",
                    adapter.version(), AOT_MODULE)
        return False
    for function, attribute in sites.AOT_CACHES:
        fn = getattr(module, function, None)
        cache = getattr(fn, attribute, None)
        if cache is None or getattr(cache, _MARKER, False):
            continue
        if not isinstance(cache, persistent_type):  # SGLANG_CUTE_AOT_CACHE_DIR="": in memory already
            continue
        _SAVED[(module.__name__, function, attribute)] = cache
        setattr(fn, attribute, _in_memory(cache, aot))
    return standing_aside(module)


def unpatch(module: ModuleType) -> None:
    """Put SGLang's persistent caches back (what ours compiled meanwhile stays in our cache)."""
    for (name, function, attribute), cache in list(_SAVED.items()):
        if name == module.__name__:
            setattr(getattr(module, function), attribute, cache)
            del _SAVED[(name, function, attribute)]


def standing_aside(module: ModuleType) -> bool:
    """Whether none of the interface's FA4 caches reads SGLang's directory now (for ``doctor`` and tests)."""
    aot = sys.modules.get(AOT_MODULE)
    persistent_type = getattr(aot, "JITPersistentCache", ())
    return not any(isinstance(getattr(getattr(module, f, None), a, None), persistent_type) for f, a in sites.AOT_CACHES)
