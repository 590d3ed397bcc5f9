"""The one hit-or-compile path that the flashinfer shim and the public API both go through.

Policy only: it decides when to look up, when to compile, when to persist, and keeps the
process's counters. Bytes and files are :mod:`.entry`'s and :mod:`.store`'s business.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from . import config, entry
from .key import CacheKey
from .store import Store

log = logging.getLogger("cute_diskcache")


@dataclass
class Counters:
    """This process's activity; ``cute_diskcache.counters()`` returns a copy."""

    hits: int = 0
    misses: int = 0
    compiles: int = 0
    writes: int = 0
    errors: int = 0  # export/load failures that fell back to the plain compile
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    saved_seconds: float = 0.0  # compile seconds recorded in the entries we loaded

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)



class CompileCache:
    """A store plus the process's counters."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.counters = Counters()
        # (site, digest, "hit" | "miss", seconds), in order: what the bench and tests read.
        self.events: list[tuple[str, str, str, float]] = []
        self._lock = threading.Lock()

    def get_or_compile(
        self,
        key: CacheKey,
        compile_fn: Callable[[], Any],
        *,
        extra_fn: Callable[[Any], dict[str, Any]] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Return ``(kernel, extra)``: loaded from disk when a verified entry exists, else compiled.

        ``extra`` is side data a site stores beside its artifact (``extra_fn(kernel)`` computes
        it after a compile); a hit returns the stored copy. A load that fails after verification
        (a DSL that cannot read the object) quarantines the entry and compiles: the caller always
        gets a kernel from one path or the other.
        """
        t0 = time.perf_counter()
        found = self.store.lookup(key)
        if found is not None:
            manifest, obj = found
            try:
                kernel = entry.load(obj, manifest["symbol"], manifest["tvm_ffi"])
            except Exception as exc:  # the DSL refused an object whose bytes we verified
                self.store.quarantine(self.store.entry_dir(key), entry.EntryError("load", f"{type(exc).__name__}: {exc}"))
            else:
                dt = time.perf_counter() - t0
                with self._lock:
                    self.counters.hits += 1
                    self.counters.load_seconds += dt
                    self.counters.saved_seconds += float(manifest["compile_seconds"])
                    self.events.append((key.site, key.digest, "hit", dt))
                log.debug("hit %s %s in %.2f ms", key.site, key.digest[:12], dt * 1e3)
                return kernel, dict(manifest["extra"])
        return self._compile_and_commit(key, compile_fn, extra_fn)

    def _compile_and_commit(
        self,
        key: CacheKey,
        compile_fn: Callable[[], Any],
        extra_fn: Callable[[Any], dict[str, Any]] | None,
    ) -> tuple[Any, dict[str, Any]]:
        t0 = time.perf_counter()
        kernel = compile_fn()
        seconds = time.perf_counter() - t0
        extra = extra_fn(kernel) if extra_fn is not None else {}
        with self._lock:
            self.counters.misses += 1
            self.counters.compiles += 1
            self.counters.compile_seconds += seconds
            self.events.append((key.site, key.digest, "miss", seconds))
        wrote = False
        if self.store.writable:
            try:
                art = entry.export(kernel, key.digest, seconds, extra)
            except Exception as exc:
                # Never let persistence break a kernel the caller already has.
                with self._lock:
                    self.counters.errors += 1
                log.warning("could not export %s kernel for the disk cache: %s", key.site, exc)
            else:
                wrote = self.store.commit(key, art) is not None
                if wrote:
                    with self._lock:
                        self.counters.writes += 1
        log.info(
            "miss %s %s: compiled in %.2f s%s",
            key.site,
            key.digest[:12],
            seconds,
            "" if wrote else " (not persisted)",
        )
        return kernel, extra


_default: CompileCache | None = None
_default_lock = threading.Lock()


def default_cache() -> CompileCache:
    """The process-wide cache for the current settings (built on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            settings = config.load()
            _default = CompileCache(Store(settings.root, readonly=settings.readonly))
        return _default


def reset_default_cache() -> None:
    """Forget the process-wide cache so the next use re-reads the environment."""
    global _default
    with _default_lock:
        _default = None
