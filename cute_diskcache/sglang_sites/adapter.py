"""SGLang's :class:`~..core.adapter.Adapter` record: the facts the library-neutral hook reads.

Its code root is the ``sglang`` package's directory. With ``CUTE_DISKCACHE_NATIVE_SITES``
naming ``sglang`` the table is empty: the FA4 kernels go back to SGLang's own ``cute_aot``
cache (which reads before anything compiles, so the hook never meets a hit of it) and the
in-memory sites compile as SGLang alone would.
"""

from __future__ import annotations

from .. import config
from ..core.adapter import Adapter, located
from . import sites
from .names import SGLANG


#: SGLang's package directory (found without importing it; None when not installed) and its version.
package_dir, version = located(SGLANG, "sglang")


def left_to_sglang() -> bool:
    """Whether SGLang's own ``cute_aot`` cache keeps its FA4 kernels (``CUTE_DISKCACHE_NATIVE_SITES`` names sglang)."""
    return config.left_to_library(SGLANG)


ADAPTER = Adapter(
    name=SGLANG,
    distribution="sglang",
    module=SGLANG,
    package_dir=package_dir,
    version=version,
    by_where={} if left_to_sglang() else sites.BY_WHERE,
    not_codegen_env=sites.NOT_CODEGEN_ENV,
    reach_by_tree=True,
    companions=sites.COMPANIONS,
)
