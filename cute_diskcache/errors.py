"""Exceptions the public API raises on purpose (everything else the cache catches and logs)."""

from __future__ import annotations


class CacheMissError(RuntimeError):
    """A kernel missed the cache and ``CUTE_DISKCACHE_ON_MISS=error`` forbids compiling it.

    For CI gates and canaries (like SGLang's ``SGLANG_CRASH_ON_JIT_COMPILE`` and vLLM's
    ``--jit-monitor-mode error``): nothing was compiled, locked or written. ``site``, ``digest``
    and ``reason`` (:func:`cute_diskcache.storage.explain.why_missed`) say which kernel and why.
    """

    def __init__(self, message: str, *, site: str, digest: str, reason: str) -> None:
        super().__init__(message)
        self.site = site
        self.digest = digest
        self.reason = reason
