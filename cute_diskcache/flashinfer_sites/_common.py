"""Owns what the flashinfer adapter's modules share: flashinfer's version and the variables of
flashinfer's that change no generated code.

The path every compile takes (``Site``, ``Call``, ``through_cache``, planning) is library-neutral
and lives in :mod:`..core.through`.
"""

from __future__ import annotations

import functools
import sys


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.6.15.post1"`` -> ``(0, 6, 15)``; stops at the first non-numeric piece."""
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits or not piece[0].isdigit():
            break
        parts.append(int(digits))
    return tuple(parts)


@functools.lru_cache(maxsize=1)
def flashinfer_version() -> str:
    """The installed flashinfer's version (asked once: every sm12x module import consults it)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get("flashinfer")
        return str(getattr(mod, "__version__", "0+unknown"))


#: flashinfer's variables that never change the code a compile generates: logging, tracing,
#: downloads and cache locations (on top of :data:`~..keys.key.NOT_CODEGEN_ENV`).
NOT_CODEGEN_ENV = frozenset({
    "FLASHINFER_WORKSPACE_BASE", "FLASHINFER_WORKSPACE_DIR", "FLASHINFER_CACHE_DIR", "FLASHINFER_LOGLEVEL",
    "FLASHINFER_LOGDEST", "FLASHINFER_LOG_LEVEL", "FLASHINFER_LOGGING_LEVEL", "FLASHINFER_JIT_VERBOSE",
    "FLASHINFER_DISABLE_VERSION_CHECK", "FLASHINFER_CUTE_DSL_DISABLE_CACHE", "FLASHINFER_TRACE_DUMP",
    "FLASHINFER_TRACE_DUMP_DIR", "FLASHINFER_TRACE_APPLY", "FLASHINFER_NO_DOWNLOAD", "FLASHINFER_AUTOTUNE_DIR",
    "SPDLOG_LEVEL", "TLLM_LOG_LEVEL", "TLLM_LOG_FIRST_RANK_ONLY",
})
