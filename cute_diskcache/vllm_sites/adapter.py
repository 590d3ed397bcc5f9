"""vLLM's :class:`~..core.adapter.Adapter` record: the facts the library-neutral hook reads.

Its code root is the ``vllm`` package's directory, found without importing vLLM. vLLM keeps its
skinny GEMM in memory only, so with ``CUTE_DISKCACHE_NATIVE_SITES`` naming ``vllm`` the table is
empty and every start compiles again, as vLLM alone would.
"""

from __future__ import annotations

import functools

from .. import config
from ..core.adapter import Adapter, distribution_version, module_dir
from . import sites
from .names import VLLM


@functools.lru_cache(maxsize=1)
def package_dir() -> str | None:
    """vLLM's package directory (found without importing it), or None when not installed."""
    return module_dir(VLLM)


@functools.lru_cache(maxsize=1)
def version() -> str:
    return distribution_version("vllm", VLLM)


def left_to_vllm() -> bool:
    """Whether vLLM keeps its own kernels (``CUTE_DISKCACHE_NATIVE_SITES`` names vllm): in memory only."""
    return config.left_to_library(VLLM)


ADAPTER = Adapter(
    name=VLLM,
    distribution="vllm",
    module=VLLM,
    package_dir=package_dir,
    version=version,
    by_where={} if left_to_vllm() else sites.BY_WHERE,
    not_codegen_env=sites.NOT_CODEGEN_ENV,
    reach_by_tree=True,
    companions=sites.COMPANIONS,
)
