"""b12x's :class:`~..core.adapter.Adapter` record: the facts the library-neutral hook reads.

Its code root is the standalone package's directory (``pip install b12x``). Where ``b12x`` is
flashinfer 0.7.4's alias package (its ``b12x/__init__.py`` loads ``flashinfer/experimental/b12x``),
b12x has no root of its own here: that code is flashinfer's embedded copy, under flashinfer's
adapter. With ``CUTE_DISKCACHE_NATIVE_SITES`` naming ``b12x``, the wrapper's file is b12x's own
disk cache (the hook hands every b12x compile back to it) and the table is empty.
"""

from __future__ import annotations

import functools
import os

from .. import config
from ..core.adapter import Adapter, distribution_version, module_dir
from . import sites
from .names import B12X


@functools.lru_cache(maxsize=1)
def package_dir() -> str | None:
    """The standalone b12x package's directory (found without importing it), or None: not
    installed, or ``b12x`` is flashinfer's alias of its embedded copy."""
    root = module_dir(B12X)
    if root is None or not os.path.isfile(os.path.join(root, sites.COMPILER_FILE)):
        return None
    flashinfer = module_dir("flashinfer")
    if flashinfer and root.startswith(flashinfer + os.sep):
        return None
    return root


@functools.lru_cache(maxsize=1)
def version() -> str:
    """The loaded b12x's version: its distribution's, once its code root is the standalone package."""
    return distribution_version("b12x", B12X)


def left_to_b12x() -> bool:
    """Whether b12x's own disk cache keeps b12x's kernels (``CUTE_DISKCACHE_NATIVE_SITES`` names b12x)."""
    return config.left_to_library(B12X)


_NATIVE = left_to_b12x()

ADAPTER = Adapter(
    name=B12X,
    distribution="b12x",
    module=B12X,
    package_dir=package_dir,
    version=version,
    by_where={} if _NATIVE else sites.BY_WHERE,
    own_disk_caches=frozenset({sites.COMPILER_FILE}) if _NATIVE else frozenset(),
    not_codegen_env=sites.NOT_CODEGEN_ENV,
    not_codegen_kwargs=sites.NOT_CODEGEN_KWARGS,
)
