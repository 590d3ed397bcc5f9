"""vLLM's :class:`~..core.adapter.Adapter` record: the facts the library-neutral hook reads.

Its code root is the ``vllm`` package's directory, found without importing vLLM. vLLM keeps its
skinny GEMM in memory only, so with ``CUTE_DISKCACHE_NATIVE_SITES`` naming ``vllm`` the table is
empty and every start compiles again, as vLLM alone would.
"""

from __future__ import annotations

from .. import config
from ..core.adapter import Adapter, located
from . import sites
from .names import VLLM


#: vLLM's package directory (found without importing it; None when not installed) and its version.
package_dir, version = located(VLLM, "vllm")


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
